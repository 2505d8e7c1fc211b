"""The Serve deployment that runs one model on vLLM: its lifecycle (engine start,
health, an engine that died), its calls, LoRA adapters through Serve's
multiplexing, and what it reports (engine load, autoscaling stats, its card).

The engine comes from the model's ``engine`` (replicas/vllm_engine.py: vLLM's
``AsyncLLM`` and its own OpenAI serving layer, built exactly as ``vllm serve``
builds them, so chat templating, sampling parameters, stop strings, n, logprobs,
tools and structured output behave as in vLLM itself); answers are put in
OpenAI's wire format by replicas/openai_json.py. The gateway's work (auth,
quotas, routing, accounting) happens in the ingress.

What ``call`` and ``stream`` answer the ingress: contract/replica_wire.py.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve

from contract.autoscaling import ENGINE_WAITING, KV_CACHE_USAGE
from contract.model_config import ModelConfig
from contract.prompt_blocks import CACHED_BLOCKS
from contract.replica_wire import (
    PROMPT_OVER_ALLOWANCE,
    PROMPT_OVER_ALLOWANCE_STATUS,
    ReplicaAnswer,
    ReplicaError,
    ReplicaOperation,
    StreamStart,
    Usage,
    as_replica_stream,
)
from replicas import reasoning
from replicas.kv_events import TRACKED_OPERATIONS, HeldPrompts, follow, prompt_tokens_in
from replicas.openai_json import (
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    finish_named_tool_calls,
    is_error,
    names_a_tool,
    openai_json,
    readable_responses_input,
    responses_json,
    responses_sse,
    validation_error,
)
from replicas.prompt_allowance import allowing
from replicas.streaming import batch_tokens, coalesce
from replicas.tracing import call_span, end_span, engine_request
from replicas.vllm_engine import engine_maker

logger = logging.getLogger("ray.serve")

# How often a replica looks whether its engine died, and how long it then waits
# (for the streams that failed with the engine to send their error events) before
# it exits so that Serve replaces it at once.
ENGINE_WATCH_INTERVAL_S = 0.5

ERROR_FLUSH_S = 1.0


@serve.deployment
class VLLMReplica:
    async def __init__(self, config: ModelConfig):  # type: ignore[misc]  # Serve awaits it
        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id
        # The engine, by what the model's `engine` names (vLLM unless rehearsing).
        binding = await engine_maker(config)(config)
        self.engine, self.load, self.max_model_len = binding.engine, binding.load, binding.max_model_len
        self._endpoints, self._serving_models = binding.endpoints, binding.serving_models
        self.reasons, self._error_from, self._facts = binding.reasons, binding.error_from, binding.facts
        self._reasoning_start = binding.reasoning_start
        self.batch_interval_s = config.stream_batch_interval_ms / 1000
        self._streams = 0  # streams started and not ended: batching applies only beside another
        if config.lora is not None:
            # Serve's model multiplexing: the loader's cache is what Serve routes by.
            async def load(adapter: str):
                return await self._load_adapter(adapter)

            self._adapter = serve.multiplexed(max_num_models_per_replica=config.lora.max_adapters_per_replica)(load)
        self._engine_watch = asyncio.get_running_loop().create_task(self._exit_when_engine_dies())
        # What the engine holds, in the router's terms, from its KV-cache events (cache_affinity).
        self._events, self._held, self._following = binding.kv_events, None, None
        if self._events is not None:
            self._held = HeldPrompts(config.routing.block_chars)
            self._following = asyncio.get_running_loop().create_task(follow(self._events.endpoint, self._held))
        logger.info("vLLM engine ready for model %s (%s)", config.name, ", ".join(self._endpoints))

    async def _exit_when_engine_dies(self) -> None:
        """A replica whose engine died exits, as `vllm serve` does
        (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH off): Serve's health check would take
        three failed periods (30 s and more) to replace it, while it keeps
        receiving requests it can only fail. An exited replica is replaced at
        once and its requests fail over (503 with retry-after at the ingress)."""
        while not self.engine.errored:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        logger.error(
            "the vLLM engine of model %s died: replica %s exits so that Serve replaces it",
            self.config.name,
            self.replica,
        )
        await asyncio.sleep(ERROR_FLUSH_S)
        os._exit(1)

    # -- requests ---------------------------------------------------------

    def _refusal(self, status: int, error: dict[str, Any]) -> ReplicaError:
        return ReplicaError(status, error, self.replica)

    async def _start(
        self, operation: str, body: dict[str, Any], adapter: str | None, span=None, prompt_allowance: int | None = None
    ):
        """vLLM's answer to ``body``: a stream, a full response, or a ``ReplicaError``;
        ``span``: the call's (vLLM's engine span joins it). ``prompt_allowance``: the
        prompt tokens the gateway reserved for it (replicas/prompt_allowance.py); a
        request whose prompts come to more never reaches the engine."""
        # Pooling renders its prompts one by one on parallel threads: they are counted
        # whole and refused at the engine's door, so the count reported is the request's.
        with allowing(prompt_allowance, whole=operation in POOLING_OPERATIONS) as allowance:
            result = await self._answer(operation, body, adapter, span)
        if allowance is not None and allowance.exceeded:
            if not isinstance(result, ReplicaError) and not is_error(result):
                await _close(result)  # not reached: the renderer raised before any engine request
            return self._refusal(
                PROMPT_OVER_ALLOWANCE_STATUS,
                {
                    "message": f"The prompt has {allowance.used} tokens; {allowance.limit} were reserved for it.",
                    "code": PROMPT_OVER_ALLOWANCE,
                    "prompt_tokens": allowance.used,
                },
            )
        if is_error(result):
            result = self._refusal(result.error.code, result.error.model_dump())
        if self.engine.errored and isinstance(result, ReplicaError):
            return self._refusal(
                503,
                {
                    "message": f"The engine of a replica of model '{self.config.name}' stopped. Please retry.",
                    "code": "replica_unavailable",
                },
            )
        return result

    async def _answer(self, operation: str, body: dict[str, Any], adapter: str | None, span=None):
        if adapter is None:  # a call through a handle names it as Serve's multiplexed model id
            adapter = serve.get_multiplexed_model_id()
        if adapter:
            try:
                if self.config.lora is None:
                    raise LookupError(adapter)
                await self._adapter(adapter)
            except LookupError:
                return self._refusal(
                    404,
                    {
                        "message": f"The model '{adapter}' does not exist or you do not have access to it.",
                        "param": "model",
                        "code": "model_not_found",
                    },
                )
            body["model"] = adapter  # vLLM applies the adapter registered under this name
        endpoint = self._endpoints.get(operation)
        if endpoint is None:
            return self._refusal(
                400,
                {
                    "message": f"Model '{self.config.name}' does not support {OPERATIONS[operation]}.",
                    "param": "model",
                },
            )
        request_type, fields, handler = endpoint
        unknown = body.keys() - fields
        if unknown:
            name = sorted(unknown)[0]
            return self._refusal(400, {"message": f"Unrecognized request argument supplied: {name}", "param": name})
        if operation == "responses":
            readable_responses_input(body)
        try:
            request = request_type.validate_python(body)
            if span is not None and takes_raw_request(handler):
                return await handler(request, engine_request(span))
            return await handler(request)
        except ValidationError as exc:
            return self._refusal(400, validation_error(exc))
        except Exception as exc:  # vLLM raises for some bad input; it maps them to statuses
            if self._error_from is None:  # a stand-in engine (no vLLM serving layer to map it)
                raise
            refusal = self._error_from(exc)
            if refusal.error.code >= 500:  # not the client's mistake: the operator needs the traceback
                logger.exception("vLLM failed on a %s request of model %s", operation, self.config.name)
            return refusal

    def _tracked(self, operation: str, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The body as the engine gets it, and the key the engine's KV-cache events about
        its prompt will carry (replicas/kv_events.py: vLLM's ``session_id``, and its
        ``kv_cache_report_mode`` full so that blocks found cached are reported too);
        None when this replica does not tell the routers what its engine holds."""
        if self._held is None or operation not in TRACKED_OPERATIONS:
            return body, None
        xargs = body.get("vllm_xargs", {})
        if not isinstance(xargs, dict):
            return body, None  # vLLM refuses it as it is
        key = self._held.start(body)
        if key is None:
            return body, None
        return {**body, "session_id": key, "vllm_xargs": {**xargs, "kv_cache_report_mode": "full"}}, key

    async def call(
        self,
        operation: ReplicaOperation,
        body: dict[str, Any],
        adapter: str | None = None,
        span=None,
        prompt_allowance: int | None = None,
    ) -> ReplicaAnswer | ReplicaError:
        body, held_key = self._tracked(operation, body)
        answer = await self._call(operation, body, adapter, span, prompt_allowance)
        if held_key is not None and isinstance(answer, ReplicaAnswer) and answer.usage is not None:
            assert self._held is not None  # a held key comes from it
            self._held.ended(held_key, answer.usage.prompt_tokens)
        return answer

    async def _call(
        self, operation: ReplicaOperation, body: dict[str, Any], adapter: str | None, span, prompt_allowance: int | None
    ) -> ReplicaAnswer | ReplicaError:
        result = await self._start(operation, body, adapter, span, prompt_allowance)
        if isinstance(result, ReplicaError):
            return result
        if isinstance(result, AsyncIterator):  # stream asked on the unary path
            await result.aclose()  # type: ignore[attr-defined]  # vLLM's streams are async generators
            return self._refusal(400, {"message": "use the streaming path for stream=true", "param": "stream"})
        if hasattr(result, "body"):  # pooling endpoints answer with a finished HTTP response
            response = json.loads(result.body)
            if result.status_code != 200:
                return self._refusal(result.status_code, response.get("error") or {"message": str(response)})
        elif operation in ("messages", "count_tokens", "responses"):  # as vLLM's Anthropic/Responses layer wrote it
            response = result.model_dump(mode="json", by_alias=True, exclude_none=operation != "responses")
            if operation == "responses":
                response = responses_json(response)
            return ReplicaAnswer(
                json.dumps(response).encode(), Usage.from_input_output(response.get("usage")), self.replica
            )
        else:
            response = result.model_dump()
            if names_a_tool(body):
                finish_named_tool_calls(response)
            if self.reasons:
                reasoning.add_to_response(response)
        return ReplicaAnswer(openai_json(response), Usage.from_openai(response.get("usage")), self.replica)

    async def call_streamed(
        self,
        operation: ReplicaOperation,
        body: dict[str, Any],
        adapter: str | None = None,
        trace: dict[str, str] | None = None,
        prompt_allowance: int | None = None,
        avoid: tuple[str, ...] = (),
    ) -> AsyncIterator[ReplicaAnswer | ReplicaError]:
        """``call``'s answer as a stream of one item, which is how the gateway sends a
        unary call: Serve's gRPC transport hands a stream to its caller when a replica
        takes it (a unary call only when it has ended), so the queue timeout bounds the
        wait for a replica only, and a cancel (a key revoked, a client gone) reaches the
        replica and the engine aborts the request. ``trace``: the gateway's span
        context (replicas/tracing.py). ``avoid``: the replicas that failed this request
        before, for the gateway's request router (contract/replica_wire.py ``AVOID``);
        nothing here."""
        span = call_span(trace, operation, self.config.name, self.replica)
        try:
            answer = await self.call(operation, body, adapter, span, prompt_allowance)
            if span is not None and isinstance(answer, ReplicaAnswer) and answer.usage is not None:
                span.set_attributes(
                    {
                        "gen_ai.usage.input_tokens": answer.usage.prompt_tokens,
                        "gen_ai.usage.output_tokens": answer.usage.completion_tokens,
                    }
                )
        finally:
            end_span(span)
        yield answer

    async def stream(
        self,
        operation: ReplicaOperation,
        body: dict[str, Any],
        adapter: str | None = None,
        trace: dict[str, str] | None = None,
        prompt_allowance: int | None = None,
        avoid: tuple[str, ...] = (),  # as call_streamed's: the router's
    ) -> AsyncIterator[StreamStart | str | ReplicaError]:
        # Counted from its start: a round of requests arriving together sees itself.
        self._streams += 1
        span = call_span(trace, operation, self.config.name, self.replica)
        try:
            body = batch_tokens(operation, body, self.config.stream_batch_tokens, others=self._streams > 1)
            body, held_key = self._tracked(operation, body)
            result = await self._start(operation, body, adapter, span, prompt_allowance)
            if isinstance(result, ReplicaError):
                yield result
                return
            if not isinstance(result, AsyncIterator):  # a full response: send it as one event
                yield StreamStart(
                    self.replica, f"data: {openai_json(result.model_dump()).decode()}\n\ndata: [DONE]\n\n"
                )
                return
            if operation == "responses":  # typed events: SSE as vLLM's own router writes them
                result = responses_sse(result)
            named_tool = operation == "chat" and names_a_tool(body)
            first = span is not None
            item = None
            async for item in as_replica_stream(self.replica, self._relayed(result, named_tool)):
                if first and span is not None:
                    span.add_event("first token")  # the engine's queue and prefill are behind it
                    first = False
                yield item
            if held_key is not None and item is not None and self._held is not None:  # the last event: its usage
                last = item.text if isinstance(item, StreamStart) else item if isinstance(item, str) else ""
                self._held.ended(held_key, prompt_tokens_in(last) if last else None)  # "": failed before output
        finally:
            self._streams -= 1
            end_span(span)

    async def _relayed(self, events: AsyncIterator[str], named_tool: bool) -> AsyncIterator[str]:
        """vLLM's SSE events, coalesced for the hop, with this model's fix-ups.

        A lone stream skips the batch interval: held 50 ms at a time, it cost 0.6 ms
        per token at c=1 on the direct route (2.9 against 2.3 ms TPOT,
        bench/serving_overhead.py --batch-ms 0) and saved nothing; beside other
        streams, fewer items are what leaves the engine its CPU."""
        async for text in coalesce(events, self.batch_interval_s, busy=lambda: self._streams > 1):
            if named_tool:
                text = text.replace(FINISH_STOP, FINISH_TOOL_CALLS)
            if self.reasons:
                text = reasoning.add_to_stream(text, self._reasoning_start)
            yield text

    # -- LoRA adapters -----------------------------------------------------

    async def _load_adapter(self, adapter: str) -> _LoadedAdapter:
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
            result = await self._serving_models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=adapter, lora_path=path)
            )
            if is_error(result):
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

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's controller hands every router of the model (each
        ``held_period_s``): the router's hashes of what this engine holds
        (replicas/kv_events.py), for cache_affinity; nothing otherwise."""
        return {CACHED_BLOCKS: self._held.published()} if self._held is not None else {}

    def model_info(self) -> dict[str, Any]:
        return {
            "id": self.config.name,
            "max_model_len": self.max_model_len,
            # What a model card lists: the API operations (every model has a tokenizer;
            # templated completions are the Databricks dialect's way to completions).
            "operations": sorted(self._endpoints.keys() & CARD_OPERATIONS),
        }

    def engine_facts(self) -> dict[str, Any]:
        """What the engine was started with and where Ray placed this replica
        (replicas/vllm_engine.py placement_facts): how a deployment is checked
        before, or without, a GPU (tests/e2e/test_gpu_rehearsal_e2e.py)."""
        return self._facts

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: it does once the engine died."""
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        if getattr(self, "_following", None) is not None:
            self._following.cancel()
        if getattr(self, "_events", None) is not None:
            self._events.remove()


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


POOLING_OPERATIONS = frozenset({"embeddings", "score", "rerank"})
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


async def _close(result) -> None:
    """End what a handler answered that will not be used (a stream's generator)."""
    if isinstance(result, AsyncIterator) and hasattr(result, "aclose"):
        await result.aclose()


@functools.cache
def takes_raw_request(handler) -> bool:
    """Whether a vLLM handler takes the HTTP request it answers (``raw_request``:
    where vLLM's serving layer reads trace headers from)."""
    try:
        return "raw_request" in inspect.signature(handler).parameters
    except (TypeError, ValueError):
        return False
