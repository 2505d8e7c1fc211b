"""The Serve deployment that runs one model on vLLM.

The replica owns a vLLM ``AsyncLLM`` and answers through vLLM's own OpenAI
serving layer, built exactly as ``vllm serve`` builds it (same argument parser,
same ``init_app_state``), so chat templating, sampling parameters, stop
strings, n, logprobs, tools and structured output behave as in vLLM itself.
The gateway's work (auth, quotas, routing, accounting) happens in the ingress.

Wire contract with the ingress (plain Python objects: cheap to pickle):
- ``chat(body)`` returns ``(status, payload, usage, replica)``: a JSON
  ``bytes`` body and its usage dict on success, an error ``dict`` (vLLM's
  ErrorInfo) and None otherwise; ``replica`` names this replica.
- ``chat_stream(body)`` yields SSE text (``str``), several events per item
  when they pile up; the first item starts with the SSE comment
  ``: replica=<id>`` (the ingress strips it). If the request fails before
  streaming, it yields exactly one ``(status, error_dict)`` tuple instead.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve

from replicas.config import DEMO_SOURCE, ModelConfig
from replicas.streaming import coalesce

logger = logging.getLogger("ray.serve")


def vllm_cli_args(config: ModelConfig, source: str) -> list[str]:
    """``vllm serve`` arguments for this model, so vLLM's own parser applies its
    types and defaults exactly as it does on the command line."""
    argv = ["--model", source, "--served-model-name", config.name]
    for key, value in config.engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def vllm_serve_command(config: ModelConfig, source: str, host: str, port: int) -> list[str]:
    """A bare `vllm serve` of the same model with the same engine options
    (parity tests and the benchmark compare the stack against it)."""
    argv = vllm_cli_args(config, source)
    argv.remove("--model")  # `vllm serve` takes the model positionally
    return [sys.executable, "-m", "replicas.vllm_cli", "serve", *argv, "--host", host, "--port", str(port)]


def resolve_source(config: ModelConfig) -> str:
    if config.source != DEMO_SOURCE:
        return config.source
    from replicas.demo_model import build_demo_model

    return str(build_demo_model())


@serve.deployment
class VLLMReplica:
    async def __init__(self, config: ModelConfig):
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        from replicas.engine_stats import EngineLoad, recorder_factory

        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._replica_comment = f": replica={self.replica}\n\n"
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            vllm_cli_args(config, resolve_source(config))
        )
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)

        self.load = EngineLoad()
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[recorder_factory(self.load)],
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
        )
        state = State()
        await init_app_state(
            self.engine, state, args, supported_tasks=await self.engine.get_supported_tasks()
        )
        self.serving_chat = state.openai_serving_chat
        self.max_model_len = vllm_config.model_config.max_model_len
        self.batch_interval_s = config.stream_batch_interval_ms / 1000
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        self._request_cls = ChatCompletionRequest
        self._error_from = create_error_response
        logger.info("vLLM engine ready for model %s", config.name)

    # -- requests ---------------------------------------------------------

    async def _start_chat(self, body: dict[str, Any]):
        """vLLM's response object for ``body``: a stream, a full response, or an error."""
        try:
            request = self._request_cls.model_validate(body)
            return await self.serving_chat.create_chat_completion(request)
        except ValidationError as exc:
            return _validation_error(exc)
        except Exception as exc:  # vLLM raises for some bad input; it maps them to statuses
            return self._error_from(exc)

    async def chat(self, body: dict[str, Any]) -> tuple[int, Any, dict | None, str]:
        result = await self._start_chat(body)
        if isinstance(result, tuple):
            return (*result, None, self.replica)
        if _is_error(result):
            return result.error.code, result.error.model_dump(), None, self.replica
        if isinstance(result, AsyncIterator):  # stream asked on the unary path
            await result.aclose()
            error = {"message": "use the streaming path for stream=true", "param": "stream"}
            return 400, error, None, self.replica
        response = result.model_dump()
        return 200, openai_json(response), response.get("usage"), self.replica

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[str | tuple]:
        result = await self._start_chat(body)
        if isinstance(result, tuple):
            yield result
            return
        if _is_error(result):
            yield result.error.code, result.error.model_dump()
            return
        if not isinstance(result, AsyncIterator):  # a full response: send it as one event
            yield f"{self._replica_comment}data: {openai_json(result.model_dump()).decode()}\n\ndata: [DONE]\n\n"
            return
        first = True
        async for text in coalesce(result, self.batch_interval_s):
            if first:
                text, first = self._replica_comment + text, False
            yield text

    # -- introspection and health ----------------------------------------

    def engine_load(self) -> dict[str, Any]:
        """Engine load as the scheduler last reported it, plus requests the
        front end still tracks (drops to zero when requests finish or abort)."""
        return {
            **self.load.as_dict(),
            "unfinished": self.engine.get_num_unfinished_requests(),
        }

    def model_info(self) -> dict[str, Any]:
        return {"id": self.config.name, "max_model_len": self.max_model_len}

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: it does once the engine died."""
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


# Fields OpenAI's spec requires but allows to be null; every other null is an
# optional field vLLM fills with None where the spec wants it absent
# (e.g. `annotations`, `usage.prompt_tokens_details`).
_REQUIRED_NULLABLE = frozenset({"content", "refusal", "logprobs", "finish_reason"})


def _drop_null_optionals(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: _drop_null_optionals(value)
            for key, value in node.items()
            if value is not None or key in _REQUIRED_NULLABLE
        }
    if isinstance(node, list):
        return [_drop_null_optionals(item) for item in node]
    return node


def openai_json(response: dict[str, Any]) -> bytes:
    """A full (non-streamed) response as OpenAI's wire format has it."""
    return json.dumps(_drop_null_optionals(response), separators=(",", ":")).encode()


def _is_error(result: Any) -> bool:
    return type(result).__name__ == "ErrorResponse"


def _validation_error(exc) -> tuple[int, dict[str, Any]]:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    message = f"{first.get('msg', 'invalid value')}" + (f" (at '{param}')" if param else "")
    return 400, {"message": message, "param": param}
