"""Databricks Foundation Model APIs / Model Serving.

``POST /serving-endpoints/{name}/invocations``: the endpoint name is the model
and the body's shape picks the task, as Databricks does: ``messages`` → chat,
``prompt`` → completions, ``input`` → embeddings. Databricks' own fields:

- completions ``use_raw_prompt`` (default false): false sends each prompt (a
  text, or a list of texts: "multiple independent prompts in one request") as
  a user message through the model's chat template, as Databricks does for
  chat models, one choice per prompt indexed by prompt; true sends the prompt
  untouched (texts or token ids). The answer is a completion either way.
- completions ``error_behavior``: ``error`` (default) answers 400 when the
  prompt does not fit the context; ``truncate`` keeps the prompt's last tokens
  so that it and ``max_tokens`` fit.
- completions ``suffix``: "a string appended to the end of each completion"
  (Databricks' meaning, not OpenAI's insertion suffix); ``echo`` as OpenAI's,
  the prompt as sent (never the template around it).
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

from serve_app.errors import RETRY_HEADERS, OpenAIError
from serve_app.wire.api_requests import COMPLETIONS_DEFAULT_MAX_TOKENS, TEMPLATED_COMPLETIONS
from serve_app.wire.calls import Call, ModelRegistry, Reply
from serve_app.wire.reservation import MAX_TOKENS_LIMIT, integer_parameter
from serve_app.wire.sse import DONE, events


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
    suffix = body.pop("suffix", None) or ""
    if not isinstance(suffix, str):
        raise OpenAIError(400, "'suffix' must be a string.", param="suffix")
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
    if raw:  # vLLM echoes a raw prompt itself
        return _finished(Call("completions", body), body, [], suffix)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(text, str) for text in prompts):
        raise OpenAIError(
            400,
            "A prompt sent through the chat template must be text or a list of texts "
            "(token ids need 'use_raw_prompt': true).",
            param="prompt",
        )
    echo = body.pop("echo", False)
    if not isinstance(echo, bool):
        raise OpenAIError(400, "'echo' must be a boolean.", param="echo")
    # The replica renders each prompt through the chat template: echoing its
    # answer would echo the template too, so the prompts as sent are echoed here.
    return _finished(Call(TEMPLATED_COMPLETIONS, body), body, prompts if echo else [], suffix)


def _finished(call: Call, body: dict[str, Any], echoed: list[str], suffix: str) -> Call:
    """``call`` answering with each choice's prompt before its text (``echoed``,
    by prompt) and ``suffix`` after it: Databricks' "a string appended to the end
    of each completion"."""
    if not echoed and not suffix:
        return call

    def edit(choice: dict[str, Any], started: set[int]) -> None:
        index = choice["index"]
        if echoed and index not in started:
            started.add(index)
            # vLLM numbers the choices prompt by prompt: n per prompt.
            choice["text"] = echoed[index // (body.get("n") or 1)] + (choice.get("text") or "")
        if suffix and choice.get("finish_reason") is not None:
            choice["text"] = (choice.get("text") or "") + suffix

    def respond(reply: Reply) -> Response:
        if reply.stream is not None:
            return StreamingResponse(
                _edited_events(reply.stream, edit), media_type="text/event-stream", headers=reply.headers
            )
        completion = reply.json()
        for choice in completion.get("choices") or ():
            edit(choice, set())
        return Response(json.dumps(completion), media_type="application/json", headers=reply.headers)

    call.respond = respond
    return call


async def _edited_events(stream: AsyncIterator[str], edit) -> AsyncIterator[str]:
    started: set[int] = set()
    async for item in stream:
        out = []
        for chunk in events(item):
            for choice in chunk.get("choices") or ():
                edit(choice, started)
            out.append(f"data: {json.dumps(chunk)}\n\n")
        yield "".join(out) + (DONE if item.endswith(DONE) else "")


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
