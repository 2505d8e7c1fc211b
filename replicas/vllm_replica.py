"""The Serve deployment that runs one model on vLLM.

The replica owns a vLLM ``AsyncLLM`` and answers through vLLM's own OpenAI
serving layer, built exactly as ``vllm serve`` builds it (same argument parser,
same ``init_app_state``), so chat templating, sampling parameters, stop
strings, n, logprobs, tools and structured output behave as in vLLM itself.
The gateway's work (auth, quotas, routing, accounting) happens in the ingress.

What ``call`` and ``stream`` answer the ingress: contract/replica_wire.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve

from replicas import reasoning
from contract.autoscaling import ENGINE_WAITING, KV_CACHE_USAGE
from contract.model_config import ModelConfig
from contract.replica_wire import (REPLICA_OPERATIONS, ReplicaAnswer, ReplicaError, ReplicaOperation, StreamStart,
                                   Usage, as_replica_stream)
from replicas.sources import resolve_source
from replicas.streaming import batch_tokens, coalesce

logger = logging.getLogger("ray.serve")

# How often a replica looks whether its engine died, and how long it then waits
# (for the streams that failed with the engine to send their error events) before
# it exits so that Serve replaces it at once.
ENGINE_WATCH_INTERVAL_S = 0.5

NO_MEDIA_DOMAIN = "media-fetching-is-off.invalid"
# A media URL that redirects could lead vLLM's fetch off the allowed domains.
MEDIA_ENV = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
ERROR_FLUSH_S = 1.0


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
    if config.lora is not None:
        argv += ["--enable-lora", "--max-loras", str(config.lora.max_adapters_per_replica),
                 "--max-lora-rank", str(config.lora.max_rank)]
    # vLLM enforces the same media policy as the gateway (defence in depth). Its
    # empty domain list means "any host", so no allowed domain is a list of one
    # that cannot resolve (RFC 2606 reserves .invalid): deny-all.
    argv += ["--allowed-media-domains", *(config.media.allowed_domains or [NO_MEDIA_DOMAIN])]
    if config.media.local_dir:
        argv += ["--allowed-local-media-path", config.media.local_dir]
    return argv


def vllm_serve_command(config: ModelConfig, source: str, host: str, port: int) -> list[str]:
    """A bare `vllm serve` of the same model with the same engine options
    (parity tests and the benchmark compare the stack against it)."""
    argv = vllm_cli_args(config, source)
    argv.remove("--model")  # `vllm serve` takes the model positionally
    return [sys.executable, "-m", "replicas.vllm_cli", "serve", *argv, "--host", host, "--port", str(port)]


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

        from replicas.engine_metrics import ray_stat_logger
        from replicas.engine_stats import EngineLoad, recorder_factory

        os.environ.update(MEDIA_ENV)  # read by vLLM when it fetches, in this process
        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id
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
            # vLLM's own metrics (queue, KV cache, prefix cache, tokens, latencies)
            # through Ray's metrics system, as Ray Serve LLM does: every node's Ray
            # metrics endpoint serves them, labelled per replica; by default
            # without the one histogram observed per token (engine_metrics.py).
            stat_loggers=[recorder_factory(self.load), ray_stat_logger(config.inter_token_latency_histogram)],
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
        )
        state = State()
        await init_app_state(
            self.engine, state, args, supported_tasks=await self.engine.get_supported_tasks()
        )
        self.max_model_len = vllm_config.model_config.max_model_len
        self.batch_interval_s = config.stream_batch_interval_ms / 1000
        self._streams = 0  # streams started and not ended: batching applies only beside another
        self._endpoints = _endpoints(state)
        self._serving_models = state.openai_serving_models
        if config.lora is not None:
            # Serve's model multiplexing: the loader's cache is what Serve routes by.
            async def load(adapter: str):
                return await self._load_adapter(adapter)

            self._adapter = serve.multiplexed(max_num_models_per_replica=config.lora.max_adapters_per_replica)(load)
        # Only a model with a reasoning parser ever carries `reasoning`.
        self.reasons = bool(getattr(args, "reasoning_parser", None))
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        self._error_from = create_error_response
        self._engine_watch = asyncio.get_running_loop().create_task(self._exit_when_engine_dies())
        logger.info("vLLM engine ready for model %s (%s)", config.name, ", ".join(self._endpoints))

    async def _exit_when_engine_dies(self) -> None:
        """A replica whose engine died exits, as `vllm serve` does
        (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH off): Serve's health check would take
        three failed periods (30 s and more) to replace it, while it keeps
        receiving requests it can only fail. An exited replica is replaced at
        once and its requests fail over (503 with retry-after at the ingress)."""
        while not self.engine.errored:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        logger.error("the vLLM engine of model %s died: replica %s exits so that Serve replaces it",
                     self.config.name, self.replica)
        await asyncio.sleep(ERROR_FLUSH_S)
        os._exit(1)

    # -- requests ---------------------------------------------------------

    def _refusal(self, status: int, error: dict[str, Any]) -> ReplicaError:
        return ReplicaError(status, error, self.replica)

    async def _start(self, operation: str, body: dict[str, Any], adapter: str | None):
        """vLLM's answer to ``body``: a stream, a full response, or a ``ReplicaError``."""
        result = await self._answer(operation, body, adapter)
        if _is_error(result):
            result = self._refusal(result.error.code, result.error.model_dump())
        if self.engine.errored and isinstance(result, ReplicaError):
            return self._refusal(503, {
                "message": f"The engine of a replica of model '{self.config.name}' stopped. Please retry.",
                "code": "replica_unavailable",
            })
        return result

    async def _answer(self, operation: str, body: dict[str, Any], adapter: str | None):
        if adapter is None:  # a call through a handle names it as Serve's multiplexed model id
            adapter = serve.get_multiplexed_model_id()
        if adapter:
            try:
                if self.config.lora is None:
                    raise LookupError(adapter)
                await self._adapter(adapter)
            except LookupError:
                return self._refusal(404, {
                    "message": f"The model '{adapter}' does not exist or you do not have access to it.",
                    "param": "model",
                    "code": "model_not_found",
                })
            body["model"] = adapter  # vLLM applies the adapter registered under this name
        endpoint = self._endpoints.get(operation)
        if endpoint is None:
            return self._refusal(400, {
                "message": f"Model '{self.config.name}' does not support {OPERATIONS[operation]}.",
                "param": "model",
            })
        request_type, fields, handler = endpoint
        unknown = body.keys() - fields
        if unknown:
            name = sorted(unknown)[0]
            return self._refusal(400, {"message": f"Unrecognized request argument supplied: {name}", "param": name})
        try:
            return await handler(request_type.validate_python(body))
        except ValidationError as exc:
            return self._refusal(400, _validation_error(exc))
        except Exception as exc:  # vLLM raises for some bad input; it maps them to statuses
            return self._error_from(exc)

    async def call(self, operation: ReplicaOperation, body: dict[str, Any], adapter: str | None = None) -> ReplicaAnswer | ReplicaError:
        result = await self._start(operation, body, adapter)
        if isinstance(result, ReplicaError):
            return result
        if isinstance(result, AsyncIterator):  # stream asked on the unary path
            await result.aclose()
            return self._refusal(400, {"message": "use the streaming path for stream=true", "param": "stream"})
        if hasattr(result, "body"):  # pooling endpoints answer with a finished HTTP response
            response = json.loads(result.body)
            if result.status_code != 200:
                return self._refusal(result.status_code, response.get("error") or {"message": str(response)})
        elif operation in ("messages", "count_tokens", "responses"):  # as vLLM's Anthropic/Responses layer wrote it
            response = result.model_dump(mode="json", by_alias=True, exclude_none=operation != "responses")
            if operation == "responses":
                response = _responses_json(response)
            return ReplicaAnswer(json.dumps(response).encode(), Usage.from_input_output(response.get("usage")),
                                 self.replica)
        else:
            response = result.model_dump()
            if _names_a_tool(body):
                _finish_named_tool_calls(response)
            if self.reasons:
                reasoning.add_to_response(response)
        return ReplicaAnswer(openai_json(response), Usage.from_openai(response.get("usage")), self.replica)

    async def call_streamed(
        self, operation: ReplicaOperation, body: dict[str, Any], adapter: str | None = None
    ) -> AsyncIterator[ReplicaAnswer | ReplicaError]:
        """``call``'s answer as a stream of one item, which is how the gateway sends a
        unary call: Serve's gRPC transport hands a stream to its caller when a replica
        takes it (a unary call only when it has ended), so the queue timeout bounds the
        wait for a replica only, and a cancel (a key revoked, a client gone) reaches the
        replica and the engine aborts the request."""
        yield await self.call(operation, body, adapter)

    async def stream(
        self, operation: ReplicaOperation, body: dict[str, Any], adapter: str | None = None
    ) -> AsyncIterator[StreamStart | str | ReplicaError]:
        # Counted from its start: a round of requests arriving together sees itself.
        self._streams += 1
        try:
            body = batch_tokens(operation, body, self.config.stream_batch_tokens, others=self._streams > 1)
            result = await self._start(operation, body, adapter)
            if isinstance(result, ReplicaError):
                yield result
                return
            if not isinstance(result, AsyncIterator):  # a full response: send it as one event
                yield StreamStart(self.replica, f"data: {openai_json(result.model_dump()).decode()}\n\ndata: [DONE]\n\n")
                return
            if operation == "responses":  # typed events: SSE as vLLM's own router writes them
                result = _responses_sse(result)
            named_tool = operation == "chat" and _names_a_tool(body)
            async for item in as_replica_stream(self.replica, self._relayed(result, named_tool)):
                yield item
        finally:
            self._streams -= 1

    async def _relayed(self, events: AsyncIterator[str], named_tool: bool) -> AsyncIterator[str]:
        """vLLM's SSE events, coalesced for the hop, with this model's fix-ups.

        A lone stream skips the batch interval: held 50 ms at a time, it cost 0.6 ms
        per token at c=1 on the direct route (2.9 against 2.3 ms TPOT,
        bench/serving_overhead.py --batch-ms 0) and saved nothing; beside other
        streams, fewer items are what leaves the engine its CPU."""
        async for text in coalesce(events, self.batch_interval_s, busy=lambda: self._streams > 1):
            if named_tool:
                text = text.replace(_FINISH_STOP, _FINISH_TOOL_CALLS)
            if self.reasons:
                text = reasoning.add_to_stream(text)
            yield text

    # -- LoRA adapters -----------------------------------------------------

    async def _load_adapter(self, adapter: str) -> "_LoadedAdapter":
        """Load ``adapter`` into the engine under its own name (called through
        Serve's multiplexing cache, once per adapter while it stays cached).
        LookupError when this model has no such adapter (raised, so Serve
        caches nothing for it)."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        from replicas.sources import resolve_adapter

        known = self._serving_models.lora_requests.get(adapter)
        if known is None:
            path = resolve_adapter(self.config, adapter)
            if path is None:
                raise LookupError(adapter)
            result = await self._serving_models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=adapter, lora_path=path))
            if _is_error(result):
                logger.warning("LoRA adapter %s failed to load: %s", adapter, result.error.message)
                raise LookupError(adapter)
            known = self._serving_models.lora_requests[adapter]
        return _LoadedAdapter(self, known)

    # -- introspection and health ----------------------------------------

    def engine_load(self) -> dict[str, Any]:
        """Engine load as the scheduler last reported it, plus requests the
        front end still tracks (drops to zero when requests finish or abort)."""
        return {
            **self.load.as_dict(),
            "unfinished": self.engine.get_num_unfinished_requests(),
            "replica": self.replica,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's controller feeds the LLM-aware policy
        (autoscale/serve_policy.py); Serve calls it only when autoscaling is on.
        The scheduler's last stats can be stale once the engine idles (no step,
        no report), so an engine with no unfinished request reports zero."""
        if self.engine.get_num_unfinished_requests() == 0:
            return {ENGINE_WAITING: 0, KV_CACHE_USAGE: 0.0}
        return {ENGINE_WAITING: self.load.waiting, KV_CACHE_USAGE: self.load.kv_cache_usage}

    def model_info(self) -> dict[str, Any]:
        return {
            "id": self.config.name,
            "max_model_len": self.max_model_len,
            # What a model card lists: the API operations (every model has a tokenizer;
            # templated completions are the Databricks dialect's way to completions).
            "operations": sorted(self._endpoints.keys() & CARD_OPERATIONS),
        }

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: it does once the engine died."""
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


class _LoadedAdapter:
    """An adapter in Serve's multiplexing cache. Serve calls ``__del__`` (in a
    worker thread) when it evicts the adapter: forget the name and free the
    engine's copy, on the replica's event loop."""

    def __init__(self, replica: VLLMReplica, request):
        import asyncio

        self._replica, self._request, self._loop = replica, request, asyncio.get_running_loop()

    def __del__(self):
        replica, request = self.__dict__.pop("_replica", None), self._request
        if replica is None or replica._serving_models.lora_requests.get(request.lora_name) is not request:
            return
        replica._serving_models.lora_requests.pop(request.lora_name, None)
        import asyncio

        remove = lambda: asyncio.ensure_future(replica.engine.remove_lora(request.lora_int_id))  # noqa: E731
        self._loop.call_soon_threadsafe(remove)


CARD_OPERATIONS = frozenset({"chat", "completions", "responses", "messages", "embeddings", "score", "rerank"})

# What each operation is called in messages to clients.
OPERATIONS = {
    "chat": "chat completions",
    "completions": "completions",
    "templated_completions": "completions through the chat template",
    "embeddings": "embeddings",
    "responses": "responses",
    "messages": "Anthropic messages",
    "count_tokens": "Anthropic token counting",
    "score": "score",
    "rerank": "rerank",
    "tokenize": "tokenize",
    "detokenize": "detokenize",
}


def _endpoints(state) -> dict[str, tuple[Any, frozenset[str], Any]]:
    """Operation -> (request validator, the fields vLLM knows, vLLM handler) for
    what this model serves: a generative model gets chat and completions, an
    embedding model embeddings, score and rerank (cosine similarity; a
    cross-encoder scores pairs itself), every model its tokenizer. vLLM's request models accept unknown fields and
    ignore them; knowing the fields lets the replica refuse them instead."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    found: dict[str, tuple[Any, frozenset[str], Any]] = {}
    chat = getattr(state, "openai_serving_chat", None)
    if chat is not None:
        found["chat"] = (TypeAdapter(ChatCompletionRequest), _field_names(ChatCompletionRequest), chat.create_chat_completion)
    completion = getattr(state, "openai_serving_completion", None)
    if completion is not None:
        found["completions"] = (TypeAdapter(CompletionRequest), _field_names(CompletionRequest), completion.create_completion)
    embedding = getattr(state, "serving_embedding", None)
    if embedding is not None:
        found["embeddings"] = (TypeAdapter(EmbeddingRequest), _field_names(EmbeddingRequest), embedding)
    responses = getattr(state, "openai_serving_responses", None)
    if responses is not None:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        found["responses"] = (TypeAdapter(ResponsesRequest), _field_names(ResponsesRequest), responses.create_responses)
    messages = getattr(state, "anthropic_serving_messages", None)
    if messages is not None:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

        found["messages"] = (TypeAdapter(AnthropicMessagesRequest), _field_names(AnthropicMessagesRequest),
                             messages.create_messages)
        found["count_tokens"] = (TypeAdapter(AnthropicCountTokensRequest), _field_names(AnthropicCountTokensRequest),
                                 messages.count_tokens)
    scores = getattr(state, "serving_scores", None)
    if scores is not None:
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

        found["score"] = (TypeAdapter(ScoreRequest), _field_names(ScoreRequest), scores)
        found["rerank"] = (TypeAdapter(RerankRequest), _field_names(RerankRequest), scores)
    tokenization = getattr(state, "serving_tokenization", None)
    if tokenization is not None:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        found["tokenize"] = (TypeAdapter(TokenizeRequest), _field_names(TokenizeRequest),
                             lambda request: tokenization.create_tokenize(request, None))
        found["detokenize"] = (TypeAdapter(DetokenizeRequest), _field_names(DetokenizeRequest),
                               lambda request: tokenization.create_detokenize(request, None))
        if chat is not None and completion is not None:
            found["templated_completions"] = (
                found["completions"][0], found["completions"][1], _templated(tokenization, completion.create_completion))
    assert found.keys() <= REPLICA_OPERATIONS, found.keys() - REPLICA_OPERATIONS  # contract/replica_wire.py names each
    return found


# Fields OpenAI's Response object requires but allows to be null; vLLM's other
# nulls (`user`, `prompt`, ...) are optional fields the spec wants absent.
_RESPONSE_REQUIRED_NULLABLE = frozenset({"error", "incomplete_details", "instructions", "metadata",
                                         "temperature", "top_p"})


def _responses_json(response: dict[str, Any]) -> dict[str, Any]:
    """A full Responses answer as OpenAI's wire format has it."""
    response = {key: _drop_nulls(value) for key, value in response.items()
                if value is not None or key in _RESPONSE_REQUIRED_NULLABLE}
    for key in _RESPONSE_REQUIRED_NULLABLE:
        response.setdefault(key, None)  # vLLM leaves `error` out
    for tool in response.get("tools") or ():
        if tool.get("type") == "function":
            tool.setdefault("strict", None)  # required, nullable
    for item in response.get("output") or ():
        for part in item.get("content") or () if item.get("type") == "message" else ():
            if part.get("type") == "output_text":
                part.setdefault("logprobs", [])  # required; vLLM leaves it null when none were asked
    return response


def _drop_nulls(node: Any) -> Any:
    """Below the top level no field of a Response is required and null (an output
    text's ``logprobs`` is an optional array, unlike chat's)."""
    if isinstance(node, dict):
        return {key: _drop_nulls(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [_drop_nulls(item) for item in node]
    return node


async def _responses_sse(events):
    async for event in events:
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def _templated(tokenization, complete):
    """A completions handler whose text prompts are each rendered as one user
    message through the model's chat template first (by vLLM's own tokenize
    path, the template chat uses), then completed as token ids: one choice per
    prompt, indexed by prompt, streamed and counted as any completion."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    async def handler(request):
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            return tokenization.create_error_response("Prompts sent through the chat template must be text.",
                                                      param="prompt")
        rendered = []
        for prompt in prompts:
            tokens = await tokenization.create_tokenize(
                TokenizeChatRequest(model=request.model, messages=[{"role": "user", "content": prompt}]), None)
            if _is_error(tokens):
                return tokens
            rendered.append(tokens.tokens)
        return await complete(request.model_copy(update={"prompt": rendered}))

    return handler


def _field_names(request_type: Any) -> frozenset[str]:
    """Field names (and aliases) of a pydantic model, or of every model in an
    ``Annotated[Union[...]]`` such as vLLM's EmbeddingRequest."""
    import typing

    if hasattr(request_type, "model_fields"):
        names = set(request_type.model_fields)
        names |= {field.alias for field in request_type.model_fields.values() if field.alias}
        return frozenset(names)
    names: set[str] = set()
    for member in typing.get_args(request_type):
        names |= _field_names(member)
    return frozenset(names)


# A forced call of one named function ends with finish_reason "stop" in vLLM;
# the gateway reports "tool_calls" for every answer that is a tool call.
_FINISH_STOP = '"finish_reason":"stop"'
_FINISH_TOOL_CALLS = '"finish_reason":"tool_calls"'


def _names_a_tool(body: dict[str, Any]) -> bool:
    return isinstance(body.get("tool_choice"), dict) and bool(body.get("tools"))


def _finish_named_tool_calls(response: dict[str, Any]) -> None:
    for choice in response.get("choices") or ():
        if choice.get("finish_reason") == "stop" and (choice.get("message") or {}).get("tool_calls"):
            choice["finish_reason"] = "tool_calls"


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
    for choice in response.get("choices") or ():
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and "content" in logprobs:
            logprobs.setdefault("refusal", None)  # chat logprobs: the spec requires it beside content
    return json.dumps(_drop_null_optionals(response), separators=(",", ":")).encode()


def _is_error(result: Any) -> bool:
    return type(result).__name__ == "ErrorResponse"


def _validation_error(exc) -> dict[str, Any]:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    message = f"{first.get('msg', 'invalid value')}" + (f" (at '{param}')" if param else "")
    return {"message": message, "param": param}
