"""OpenAI's error envelope: the one shape every error leaves the gateway in.

``{"error": {"message": str, "type": str, "param": str|null, "code": str|null}}``
with the HTTP status saying what kind of failure it is (docs/architecture.md, Conventions).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

# OpenAI's `type` for each status class; its SDK maps the status to an
# exception class, the type is what people read in logs.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable_error",
}


# What a 503 tells the client to wait: a hint, the queue drains continuously.
UNAVAILABLE_RETRY_S = 1
RETRY_HEADERS = {"retry-after": str(UNAVAILABLE_RETRY_S), "retry-after-ms": str(UNAVAILABLE_RETRY_S * 1000)}


class OpenAIError(Exception):
    """Raised anywhere in the gateway; turned into the envelope by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type_for(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return envelope(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return error_response(self.status, self.body(), self.headers)


def unknown_model(model: str) -> OpenAIError:
    """The one answer for a model that does not exist and for one the caller may not use
    (its key's or its team's list): OpenAI's wording covers both, so a restricted key
    cannot learn which models exist from a difference."""
    return OpenAIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def invalid_request(exc: ValidationError) -> OpenAIError:
    """The one 400 for a pydantic validation failure of a client's input: its
    first error, naming the top-level parameter (OpenAI's wording)."""
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{where}'."
    elif where == "messages" and first.get("type") == "too_short":
        message = "'messages' must contain at least one message."
    else:
        message = f"Invalid value for '{where}': {first.get('msg')}."
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return OpenAIError(400, message, param=param, code=code)


# How much of a client's value an error message echoes: enough to recognise it,
# never the value itself (an error is stored with a batch, logged, sent back).
SHOWN_CHARS = 64


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was when cut."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def error_type_for(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body).encode(),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def from_engine_error(status: int, error: dict[str, Any]) -> OpenAIError:
    """Normalise an error the engine produced (vLLM's ErrorInfo: numeric `code`,
    exception-class `type`) into OpenAI's envelope, keeping message and param."""
    message = str(error.get("message") or HTTPStatus(status).phrase)
    code = error.get("code")  # vLLM's is the numeric status; the replica's own are names
    return OpenAIError(
        status, message, param=error.get("param"), code=code if isinstance(code, str) else _engine_code(status)
    )


def _engine_code(status: int) -> str | None:
    if status == 404:
        return "not_found"
    if status >= 500:
        return "engine_error"
    return None


def quota_store_error() -> OpenAIError:
    """Redis answered with an error (script, OOM, READONLY, MOVED): a server fault, never admission."""
    return _quota_store_503("The service could not check quotas right now (quota store error).", "quota_backend_error")


def quota_store_unavailable() -> OpenAIError:
    """Redis did not answer and ``fail_mode`` is closed (or no cached key may stand in)."""
    return _quota_store_503("The service cannot check quotas right now.", "quota_backend_unavailable")


def gateway_overloaded() -> OpenAIError:
    """This ingress is too busy to hear Redis in time (admission/loop_lag.py): shed."""
    return OpenAIError(
        503, "The service is overloaded. Please retry shortly.", code="gateway_overloaded", headers=dict(RETRY_HEADERS)
    )


def records_backlog() -> OpenAIError:
    """The record sink has not taken ``records.max_backlog`` final records: no new request until it does."""
    return _quota_store_503(
        "The service cannot record requests right now (its record sink is behind).", "records_backlog"
    )


def _quota_store_503(message: str, code: str) -> OpenAIError:
    return OpenAIError(503, f"{message} Please retry shortly.", code=code, headers=dict(RETRY_HEADERS))
