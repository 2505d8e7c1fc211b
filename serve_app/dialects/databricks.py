"""Databricks Foundation Model APIs / Model Serving.

``POST /serving-endpoints/{name}/invocations``: the endpoint name is the model
and the body's shape picks the task, as Databricks does: ``messages`` → chat,
``prompt`` → completions, ``input`` → embeddings. Databricks' own fields:

- completions ``use_raw_prompt`` (default false): false wraps the prompt as a
  user message in the model's chat template, as Databricks does for chat
  models; true sends it untouched. The answer is a completion either way.
- completions ``error_behavior``: ``error`` (default) answers 400 when the
  prompt does not fit the context; ``truncate`` keeps the prompt's last tokens
  so that it and ``max_tokens`` fit.
- completions ``suffix``, ``echo``: as OpenAI's (vLLM refuses ``suffix``).
- embeddings ``instruction``: prefixed to every input, for instruction-tuned
  embedding models.

The OpenAI client pointed at ``/serving-endpoints`` (Databricks' documented
way) uses the OpenAI routes under that prefix; they are plain OpenAI.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from serve_app.api_requests import COMPLETIONS_DEFAULT_MAX_TOKENS
from serve_app.calls import Call, ModelRegistry, Reply
from serve_app.errors import OpenAIError
from serve_app.gateway import RETRY_HEADERS
from serve_app.reservation import MAX_TOKENS_LIMIT, integer_parameter
from serve_app.sse import DONE, events


async def translate(name: str, body: dict[str, Any], gateway: ModelRegistry) -> Call:
    body["model"] = name
    if "messages" in body:
        return Call("chat", body)
    if "prompt" in body:
        return await _completion(body, gateway)
    if "input" in body:
        return Call("embeddings", _embedding(body))
    raise OpenAIError(
        400,
        "The request needs 'messages' (chat), 'prompt' (completions) or 'input' (embeddings).",
        param="messages",
        code="missing_required_parameter",
    )


async def _completion(body: dict[str, Any], gateway: ModelRegistry) -> Call:
    behaviour = body.pop("error_behavior", None) or "error"
    if behaviour not in ("error", "truncate"):
        raise OpenAIError(400, "'error_behavior' must be 'error' or 'truncate'.", param="error_behavior")
    raw = body.pop("use_raw_prompt", False)
    if not isinstance(raw, bool):
        raise OpenAIError(400, "'use_raw_prompt' must be a boolean.", param="use_raw_prompt")
    if behaviour == "truncate":
        await gateway.model_card(body["model"])  # learns the context length (bounded wait)
        context = gateway.context_length(gateway.resolve(body["model"]))
        if context is None:  # scaled to zero and never started, or busy past its queue timeout
            raise OpenAIError(
                503,
                "The model's context length is not known until one of its replicas has started; retry shortly.",
                code="model_unavailable",
                headers=RETRY_HEADERS,
            )
        max_tokens = integer_parameter(body, "max_tokens", 0, MAX_TOKENS_LIMIT)
        room = context - (COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        if room < 1:
            raise OpenAIError(400, "'max_tokens' leaves no room for the prompt.", param="max_tokens")
        body["truncate_prompt_tokens"] = room
    if raw:
        return Call("completions", body)
    return _templated_completion(body)


def _templated_completion(body: dict[str, Any]) -> Call:
    """A completion through the chat template, answered as a completion."""
    prompt = body.pop("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError(400, "A list of prompts needs 'use_raw_prompt': true.", param="prompt")
    for name in ("suffix", "logprobs"):
        if body.get(name) is not None:
            raise OpenAIError(400, f"'{name}' needs 'use_raw_prompt': true.", param=name)
    echo = bool(body.pop("echo", False))
    body["messages"] = [{"role": "user", "content": prompt}]
    echoed = prompt if echo else ""
    if body.get("stream"):
        return Call("chat", body, lambda reply: _stream_as_completion(reply, echoed))
    return Call("chat", body, lambda reply: _as_completion(reply, echoed))


def _as_completion(reply: Reply, echoed: str) -> Response:
    chat = json.loads(reply.body)
    completion = {
        "id": chat["id"].replace("chatcmpl-", "cmpl-", 1),
        "object": "text_completion",
        "created": chat["created"],
        "model": chat["model"],
        "choices": [
            {
                "index": choice["index"],
                "text": echoed + (choice["message"].get("content") or ""),
                "logprobs": None,
                "finish_reason": choice["finish_reason"],
            }
            for choice in chat["choices"]
        ],
        "usage": chat.get("usage"),
    }
    return Response(json.dumps(completion), media_type="application/json", headers=reply.headers)


def _stream_as_completion(reply: Reply, echoed: str) -> Response:
    return StreamingResponse(_completion_events(reply.stream, echoed), media_type="text/event-stream", headers=reply.headers)


async def _completion_events(stream: AsyncIterator[str], echoed: str):
    first = True
    async for item in stream:
        out = []
        for chunk in events(item):
            if "error" in chunk:
                out.append(chunk)
                continue
            choices = []
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if first and echoed:
                    text, first = echoed + text, False
                choices.append(
                    {"index": choice["index"], "text": text, "logprobs": None, "finish_reason": choice.get("finish_reason")}
                )
            completion = {
                "id": chunk["id"].replace("chatcmpl-", "cmpl-", 1),
                "object": "text_completion",
                "created": chunk["created"],
                "model": chunk["model"],
                "choices": choices,
            }
            if chunk.get("usage"):
                completion["usage"] = chunk["usage"]
            out.append(completion)
        text = "".join(f"data: {json.dumps(event)}\n\n" for event in out)
        yield text + (DONE if item.endswith(DONE) else "")


def _embedding(body: dict[str, Any]) -> dict[str, Any]:
    instruction = body.pop("instruction", None)
    if instruction is None:
        return body
    if not isinstance(instruction, str):
        raise OpenAIError(400, "'instruction' must be a string.", param="instruction")
    inputs = body["input"]
    if isinstance(inputs, str):
        body["input"] = _instructed(instruction, inputs)
    elif isinstance(inputs, list) and all(isinstance(text, str) for text in inputs):
        body["input"] = [_instructed(instruction, text) for text in inputs]
    else:
        raise OpenAIError(400, "'instruction' needs text input, not token ids.", param="instruction")
    return body


def _instructed(instruction: str, text: str) -> str:
    return instruction + text if instruction.endswith((" ", "\n")) else f"{instruction} {text}"
