"""An engine without a model: ``engine: replicas.instant_engine:start_instant``.

Every chat request is answered with ``max_tokens`` tokens ("x" each) per choice
(``n`` of them), streamed one token per item as vLLM's serving layer streams them,
with the usage trailer a stream asks for; embeddings get a fixed vector per input.
The replica around it runs as it does for vLLM (request validation by vLLM's own
request models, the fields check, coalescing, usage), so what a load costs is the
gateway's alone: bench/gateway_capacity.py measures it with this, as fast as it goes,
and the soak harness (soak/) runs most of its models on it at a set pace
(``engine_kwargs: {token_interval_s: 0.02}``: a token every 20 ms, as a GPU streams).

Prompt tokens are counted as the UTF-8 bytes of the text read, over four: never more
than the gateway reserved for the request (its estimate is the body's bytes over
four), as vLLM's renderer would refuse a prompt past its allowance."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from contract.model_config import ModelConfig
from replicas.rehearsal import IdleEngine
from replicas.vllm_engine import EngineBinding, field_names

EMBEDDING_SIZE = 8


class _Answer:
    def __init__(self, response: dict[str, Any]):
        self._response = response

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return self._response


def _text_tokens(*texts: Any) -> int:
    """What a prompt of these texts is said to have read: bytes / 4, at least 1."""
    return max(1, sum(len(json.dumps(text, ensure_ascii=False).encode()) - 2 for text in texts) // 4)


def _chat_prompt_tokens(request) -> int:
    return _text_tokens(*(message.get("content") or "" for message in request.messages))


def _answer(request, token_interval_s: float) -> Any:
    n, choices = request.max_tokens or 16, request.n or 1
    prompt = _chat_prompt_tokens(request)
    usage = {"prompt_tokens": prompt, "completion_tokens": n * choices, "total_tokens": prompt + n * choices}
    if not request.stream:

        async def whole():
            await asyncio.sleep(token_interval_s * n)
            return _Answer(
                {
                    "id": "chatcmpl-instant",
                    "object": "chat.completion",
                    "created": 0,
                    "model": request.model,
                    "choices": [
                        {
                            "index": index,
                            "message": {"role": "assistant", "content": "x" * n},
                            "finish_reason": "length",
                            "logprobs": None,
                        }
                        for index in range(choices)
                    ],
                    "usage": usage,
                }
            )

        return whole()
    head = (
        f'{{"id":"chatcmpl-instant","object":"chat.completion.chunk","created":0,"model":"{request.model}","choices":'
    )

    async def steps():
        for index in range(choices):
            yield f'data: {head}[{{"index":{index},"delta":{{"role":"assistant","content":""}}}}]}}\n\n'
        for _ in range(n):
            for index in range(choices):
                yield f'data: {head}[{{"index":{index},"delta":{{"content":"x"}}}}]}}\n\n'
            # one engine step: let the replica's pump ship what piled up
            await asyncio.sleep(token_interval_s)
        if request.stream_options and request.stream_options.include_usage:
            yield f'data: {head}[],"usage":{json.dumps(usage)}}}\n\n'
        yield "data: [DONE]\n\n"

    return steps()


def _embeddings(request) -> _Answer:
    inputs = request.input if isinstance(request.input, list) else [request.input]
    if inputs and isinstance(inputs[0], int):  # one prompt of token ids
        inputs = [inputs]
    tokens = sum(len(item) if isinstance(item, list) else _text_tokens(item) for item in inputs)
    return _Answer(
        {
            "object": "list",
            "model": request.model,
            "data": [
                {"object": "embedding", "index": index, "embedding": [0.125] * EMBEDDING_SIZE}
                for index in range(len(inputs))
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def start_instant(config: ModelConfig) -> EngineBinding:
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    from replicas.engine_stats import EngineLoad

    token_interval_s = float(config.engine_kwargs.get("token_interval_s", 0.0))

    async def chat(request):
        answer = _answer(request, token_interval_s)
        return await answer if asyncio.iscoroutine(answer) else answer

    async def embeddings(request):
        return _embeddings(request)

    return EngineBinding(
        engine=IdleEngine(),
        load=EngineLoad(),
        max_model_len=1 << 20,
        endpoints={
            "chat": (TypeAdapter(ChatCompletionRequest), field_names(ChatCompletionRequest), chat),
            "embeddings": (TypeAdapter(EmbeddingRequest), field_names(EmbeddingRequest), embeddings),
        },
        facts={"engine": "instant (no model)", "token_interval_s": token_interval_s},
    )
