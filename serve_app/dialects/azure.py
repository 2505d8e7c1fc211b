"""Azure AI model inference (Azure AI Foundry "models" endpoint).

``POST /chat/completions`` and ``/embeddings`` (also under ``/models``), with
``?api-version=...``, the key in ``api-key`` or ``Authorization``, the model in
the body or the ``azureml-model-deployment`` header, and the
``extra-parameters`` header deciding what happens to parameters outside
Azure's API: ``error`` (the default, 422), ``drop`` (also spelled ``ignore``)
or ``pass-through`` (forwarded to the model). Errors carry Azure's
``x-ms-error-code`` header; a body that is valid JSON but has invalid
parameters is 422 (Unprocessable Content) as Azure answers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse, Response

from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.wire.calls import Call, ModelRegistry

# The request fields of Azure's API (azure-ai-inference REST spec).
KNOWN_PARAMETERS = {
    "chat": frozenset(
        {
            "messages",
            "model",
            "frequency_penalty",
            "presence_penalty",
            "temperature",
            "top_p",
            "max_tokens",
            "response_format",
            "stop",
            "stream",
            "tools",
            "tool_choice",
            "seed",
        }
    ),
    "embeddings": frozenset({"input", "model", "dimensions", "encoding_format", "input_type"}),
}
EXTRA_PARAMETER_MODES = ("error", "drop", "ignore", "pass-through")
MODEL_TYPES = {"chat": "chat-completion", "completions": "completion", "embeddings": "embeddings"}


async def translate(operation: str, body: dict[str, Any], headers: Mapping[str, str], gateway: ModelRegistry) -> Call:
    mode = headers.get("extra-parameters", "error").strip().lower()
    if mode not in EXTRA_PARAMETER_MODES:
        raise OpenAIError(
            400,
            f"Invalid 'extra-parameters' header {mode!r}: use one of {', '.join(EXTRA_PARAMETER_MODES)}.",
            param="extra-parameters",
            code="invalid_header",
        )
    extra = sorted(body.keys() - KNOWN_PARAMETERS[operation])
    if extra and mode == "error":
        raise OpenAIError(
            422,
            f"Extra parameters {extra} are not allowed when 'extra-parameters' is not set or set to 'error'. "
            "Set the header to 'pass-through' to send them to the model, or 'drop' to ignore them.",
            param=extra[0],
            code="extra_parameters_not_allowed",
        )
    if extra and mode in ("drop", "ignore"):
        for name in extra:
            del body[name]
    # input_type (query/document) only matters to asymmetric embedding models; the
    # models served here embed both alike.
    body.pop("input_type", None)
    deployment = headers.get("azureml-model-deployment")
    if deployment:
        body["model"] = deployment
    elif "model" not in body:
        body["model"] = await gateway.only_model_for(operation)
    return Call(operation, body)


async def info(key: KeyRecord, headers: Mapping[str, str], gateway: ModelRegistry) -> Response:
    """``GET /info``: what the (selected) deployment serves, if ``key`` may use it."""
    model = headers.get("azureml-model-deployment") or await gateway.only_model_for(None)
    gateway.authorized(key, model)
    card = await gateway.model_card(model)
    operation = (card.get("capabilities") or [None])[0]  # none yet: a scale-to-zero model not started
    return JSONResponse(
        {
            "model_name": card["id"],
            "model_type": MODEL_TYPES.get(operation, "unknown"),
            "model_provider_name": card["owned_by"],
        }
    )


def error_response(exc: OpenAIError) -> Response:
    """OpenAI's envelope with Azure's status conventions and error-code header."""
    if exc.status == 400 and exc.param is not None and exc.param != "extra-parameters":
        exc.status = 422  # valid JSON, unprocessable parameters
    code = exc.code or HTTPStatus(exc.status).phrase.replace(" ", "")
    exc.headers = {**exc.headers, "x-ms-error-code": code}
    return exc.response()
