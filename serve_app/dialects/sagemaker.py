"""Amazon SageMaker LMI (Large Model Inference) containers.

``POST /invocations`` dispatches by body shape, as LMI does: ``messages`` is
an OpenAI chat request, ``prompt`` an OpenAI completion request (both answered
in OpenAI's format, streams as OpenAI SSE), and ``inputs`` + ``parameters``
is LMI's own text-generation schema, answered as ``{"generated_text": ...}``
(plus ``details`` when asked) or, with ``"stream": true``, as JSON lines of
``{"token": {...}, "generated_text": null, "details": null}`` ending with one
that carries the whole text. ``GET /ping`` is SageMaker's health check: the ingress answers it as readiness
(``/ready``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.errors import OpenAIError
from serve_app.wire.calls import Call, ModelRegistry, Reply
from serve_app.wire.sse import events

# LMI's defaults: greedy decoding, 30 new tokens.
LMI_DEFAULT_MAX_NEW_TOKENS = 30

# LMI generation parameter -> OpenAI/vLLM completion parameter.
LMI_PARAMETERS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "stop_sequences": "stop",
    "stop": "stop",
    "ignore_eos_token": "ignore_eos",
}
_LMI_FLAGS = {"do_sample", "details", "return_full_text"}


async def translate(body: dict[str, Any], gateway: ModelRegistry) -> Call:
    if "messages" in body:
        call = Call("chat", body)
    elif "prompt" in body:
        call = Call("completions", body)
    elif "inputs" in body:
        call = _lmi_call(body)
    else:
        raise OpenAIError(
            400,
            "The invocation body needs 'messages' (chat), 'prompt' (completions) or 'inputs' (LMI text generation).",
            param="inputs",
            code="missing_required_parameter",
        )
    if "model" not in call.body:
        operation = call.operation if isinstance(call.operation, str) else call.operation.name
        call.body["model"] = await gateway.only_model_for(operation)
    return call


def _lmi_call(body: dict[str, Any]) -> Call:
    unknown = sorted(body.keys() - {"inputs", "parameters", "stream", "model"})
    if unknown:
        raise OpenAIError(400, f"Unknown field '{unknown[0]}' in an LMI request.", param=unknown[0])
    parameters = body.get("parameters")
    inputs, parameters, stream = body["inputs"], {} if parameters is None else parameters, bool(body.get("stream"))
    if not isinstance(parameters, dict):
        raise OpenAIError(400, "'parameters' must be an object.", param="parameters")
    if not (
        isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs))
    ):
        raise OpenAIError(400, "'inputs' must be a string or a list of strings.", param="inputs")
    if stream and isinstance(inputs, list):
        raise OpenAIError(400, "Streaming takes one input string, not a list.", param="inputs")
    unknown = sorted(parameters.keys() - LMI_PARAMETERS.keys() - _LMI_FLAGS)
    if unknown:
        raise OpenAIError(400, f"Unsupported LMI parameter '{unknown[0]}'.", param=f"parameters.{unknown[0]}")

    request: dict[str, Any] = {"prompt": inputs, "max_tokens": LMI_DEFAULT_MAX_NEW_TOKENS}
    for name, value in parameters.items():
        if name in LMI_PARAMETERS:
            request[LMI_PARAMETERS[name]] = value
    if not parameters.get("do_sample"):
        request["temperature"] = 0  # LMI decodes greedily unless do_sample is set
    details = bool(parameters.get("details"))
    if details or stream:
        # per-token ids and log-probabilities for `details` and stream tokens
        request.update(logprobs=0, return_token_ids=True)
    if "model" in body:
        request["model"] = body["model"]
    prefix_prompt = bool(parameters.get("return_full_text"))
    if stream:
        assert isinstance(inputs, str)  # a list was refused above
        request.update(stream=True)
        return Call("completions", request, lambda reply: _stream_response(reply, inputs, prefix_prompt, details))
    return Call("completions", request, lambda reply: _json_response(reply, inputs, prefix_prompt, details))


def _finish_reason(choice: dict[str, Any]) -> str:
    """LMI's names: length, eos_token, stop_sequence."""
    if choice.get("finish_reason") == "length":
        return "length"
    return "stop_sequence" if isinstance(choice.get("stop_reason"), str) else "eos_token"


def _tokens(choice: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = choice.get("logprobs") or {}
    texts = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    ids = choice.get("token_ids") or []
    return [{"id": i, "text": t, "log_prob": lp} for i, t, lp in zip(ids, texts, values)]


def _json_response(reply: Reply, inputs, prefix_prompt: bool, details: bool) -> Response:
    body = reply.json()
    prompts = inputs if isinstance(inputs, list) else [inputs]
    outputs = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        prompt = prompts[choice["index"]]
        output: dict[str, Any] = {"generated_text": (prompt if prefix_prompt else "") + choice["text"]}
        if details:
            tokens = _tokens(choice)
            output["details"] = {
                "finish_reason": _finish_reason(choice),
                "generated_tokens": len(tokens),
                "inputs": prompt,
                "tokens": tokens,
            }
        outputs.append(output)
    return JSONResponse(outputs if isinstance(inputs, list) else outputs[0], headers=reply.headers)


def _stream_response(reply: Reply, prompt: str, prefix_prompt: bool, details: bool) -> Response:
    if reply.stream is None:
        raise ValueError("a streamed call answered without a stream")
    return StreamingResponse(
        _json_lines(reply.stream, prompt, prefix_prompt, details),
        media_type="application/jsonlines",
        headers=reply.headers,
    )


async def _json_lines(stream: AsyncIterator[str], prompt: str, prefix_prompt: bool, details: bool):
    text, count = [], 0
    async for item in stream:
        lines = []
        for event in events(item):
            if event.get("error"):
                lines.append(json.dumps({"error": event["error"]}))
                continue
            for choice in event.get("choices") or ():
                delta = choice.get("text", "")
                tokens = _tokens(choice) or [{"id": None, "text": delta, "log_prob": None}]
                if len(tokens) == 1:
                    tokens[0]["text"] = delta  # the detokenised text, not the raw token string
                text.append(delta)
                count += len(tokens)
                last = choice.get("finish_reason") is not None
                for token in tokens[:-1]:
                    lines.append(json.dumps({"token": token, "generated_text": None, "details": None}))
                final: dict[str, Any] = {"token": tokens[-1], "generated_text": None, "details": None}
                if last:
                    final["generated_text"] = (prompt if prefix_prompt else "") + "".join(text)
                    if details:
                        final["details"] = {
                            "finish_reason": _finish_reason(choice),
                            "generated_tokens": count,
                            "inputs": prompt,
                        }
                lines.append(json.dumps(final))
        if lines:
            yield "\n".join(lines) + "\n"
