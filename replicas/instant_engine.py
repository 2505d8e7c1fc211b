"""An engine that costs nothing: ``engine: replicas.instant_engine:start_instant``.

Every chat request is answered at once with its ``max_tokens`` tokens ("x" each),
streamed one token per item as vLLM's serving layer streams them, with the usage
trailer a stream asks for. The replica around it runs as it does for vLLM (request
validation by vLLM's own chat model, the fields check, coalescing, usage), so what a
load costs is the gateway's alone: bench/gateway_capacity.py measures it with this."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from contract.model_config import ModelConfig
from replicas.rehearsal import IdleEngine
from replicas.vllm_engine import EngineBinding, field_names

PROMPT_TOKENS = 8  # what every request is said to have read


class _Answer:
    def __init__(self, response: dict[str, Any]):
        self._response = response

    def model_dump(self) -> dict[str, Any]:
        return self._response


def _answer(request) -> Any:
    n = request.max_tokens or 16
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}
    if not request.stream:
        return _Answer(
            {
                "id": "chatcmpl-instant",
                "object": "chat.completion",
                "created": 0,
                "model": request.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "x" * n},
                        "finish_reason": "length",
                        "logprobs": None,
                    }
                ],
                "usage": usage,
            }
        )
    head = (
        f'{{"id":"chatcmpl-instant","object":"chat.completion.chunk","created":0,"model":"{request.model}","choices":'
    )

    async def steps():
        yield f'data: {head}[{{"index":0,"delta":{{"role":"assistant","content":""}}}}]}}\n\n'
        for _ in range(n):
            yield f'data: {head}[{{"index":0,"delta":{{"content":"x"}}}}]}}\n\n'
            await asyncio.sleep(0)  # one engine step: let the replica's pump ship what piled up
        if request.stream_options and request.stream_options.include_usage:
            yield f'data: {head}[],"usage":{json.dumps(usage)}}}\n\n'
        yield "data: [DONE]\n\n"

    return steps()


async def start_instant(config: ModelConfig) -> EngineBinding:
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from replicas.engine_stats import EngineLoad

    async def chat(request):
        return _answer(request)

    return EngineBinding(
        engine=IdleEngine(),
        load=EngineLoad(),
        max_model_len=1 << 20,
        endpoints={"chat": (TypeAdapter(ChatCompletionRequest), field_names(ChatCompletionRequest), chat)},
        facts={"engine": "instant (no model)"},
    )
