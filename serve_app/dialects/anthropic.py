"""Anthropic's Messages API: ``POST /v1/messages``.

The request goes to the replica as it is: vLLM's own Anthropic layer
(``AnthropicServingMessages``) turns it into a chat completion and the answer
back into a message, streams included (Anthropic's named SSE events). What the
gateway adds is what it adds to every route: the key (Anthropic clients send it
as ``x-api-key``), the key's models and quotas, accounting. On this route alone
errors take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``,
with the same statuses and headers (retry-after, rate-limit headers) as
everywhere else.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from serve_app.errors import OpenAIError

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_response(exc: OpenAIError) -> Response:
    kind = _ERROR_TYPES.get(exc.status) or ("api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message if exc.param is None or f"'{exc.param}'" in exc.message else f"{exc.message} ({exc.param})"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return Response(
        json.dumps(body).encode(), status_code=exc.status, media_type="application/json", headers=exc.headers
    )
