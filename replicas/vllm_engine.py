"""Starting vLLM for a model as ``vllm serve`` does, and binding its OpenAI serving
layer: the command-line arguments a model's config makes, vLLM's ``AsyncLLM`` (or
what the maker a model's ``engine`` names returns instead), and which vLLM handler
answers each replica operation."""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contract.model_config import ModelConfig
from contract.replica_wire import REPLICA_OPERATIONS
from replicas.kv_events import EventSocket
from replicas.openai_json import is_error
from replicas.prompt_allowance import enforce_on, guard_the_door, uncounted
from replicas.sources import resolve_source

if TYPE_CHECKING:  # vLLM is imported when an engine starts, not with this module (the gateway imports it)
    from replicas.engine_stats import EngineLoad


@dataclass
class EngineBinding:
    """A started engine and what a replica answers with (``start_vllm`` makes it;
    a model's ``engine`` may name another maker, as the rehearsal does)."""

    # vLLM's AsyncLLM, or what stands in for it: ``errored``, ``check_health()``,
    # ``get_num_unfinished_requests()``, ``shutdown()``, ``remove_lora(id)``.
    engine: Any
    load: EngineLoad  # the scheduler's last stats (autoscaling, llmctl status)
    max_model_len: int
    # Operation -> (request validator, the fields vLLM knows, vLLM handler).
    endpoints: dict[str, tuple[Any, frozenset[str], Any]]
    serving_models: Any = None  # vLLM's OpenAIServingModels: LoRA adapters
    reasons: bool = False  # a reasoning parser: answers may carry `reasoning`
    reasoning_start: str | None = None  # its start tag, which a stream's delta may leak (replicas/reasoning.py)
    error_from: Callable[[Exception], Any] | None = None  # vLLM's error response for an exception it raised
    facts: dict[str, Any] = field(default_factory=dict)  # what it was started with, where (engine_facts)
    kv_events: EventSocket | None = None  # where its KV-cache events are published (replicas/kv_events.py)


def reasoning_start_tag(parser_name: str | None) -> str | None:
    """The start tag of a thinking parser (``<think>``); None for other parsers."""
    if not parser_name:
        return None
    from vllm.reasoning import ReasoningParserManager

    try:
        # vLLM's thinking parsers declare it as a constant property of the class.
        tag = ReasoningParserManager.get_reasoning_parser(parser_name).start_token.fget(None)
    except Exception:  # not a thinking parser, or one that needs its tokenizer for it
        return None
    return tag if isinstance(tag, str) and tag else None


def engine_maker(config: ModelConfig) -> Callable[[ModelConfig], Awaitable[EngineBinding]]:
    """What ``config.engine`` names (``module:function``)."""
    module, _, name = config.engine.partition(":")
    return getattr(importlib.import_module(module), name)


def engine_config(config: ModelConfig, extra_cli: Sequence[str] = ()):
    """(vLLM's parsed CLI arguments, its engine arguments, its ``VllmConfig``) for
    ``config`` (and ``extra_cli``), as ``vllm serve`` makes them from the same command
    line; this process's environment set as vLLM must find it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    os.environ.update(MEDIA_ENV)  # read by vLLM when it fetches, in this process
    for name, value in compile_env(config).items():  # read by the engine's processes, started from this one
        os.environ.setdefault(name, value)  # a model's own `env` wins
    cli = vllm_cli_args(config, resolve_source(config)) + list(extra_cli)
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:  # telemetry.tracing: vLLM's own span of each traced request (replicas/tracing.py joins it)
        cli += ["--otlp-traces-endpoint", traces]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli)
    validate_parsed_serve_args(args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return args, engine_args, engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def placement_facts(vllm_config) -> dict[str, Any]:
    """Where Ray placed this replica and what vLLM decided from it: the engine's
    parallel layout and executor, the replica's placement group and resources, the
    devices it sees, and the environment vLLM and Serve read."""
    import ray
    from ray.util import get_current_placement_group

    parallel = vllm_config.parallel_config
    group = get_current_placement_group()
    context = ray.get_runtime_context()
    return {
        "model": vllm_config.model_config.model,
        "served_model_name": vllm_config.model_config.served_model_name,
        "max_model_len": vllm_config.model_config.max_model_len,
        "device": str(vllm_config.device_config.device),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "world_size": parallel.world_size,
        "executor_backend": str(parallel.distributed_executor_backend),
        "placement_group_bundles": group.bundle_specs if group is not None else None,
        "assigned_resources": context.get_assigned_resources(),
        "accelerator_ids": context.get_accelerator_ids(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "env": {key: value for key, value in os.environ.items() if key.startswith(("VLLM_", "RAY_SERVE_"))},
    }


async def start_vllm(config: ModelConfig) -> EngineBinding:
    """vLLM's ``AsyncLLM`` for ``config`` and its OpenAI serving layer, built exactly as
    ``vllm serve`` builds them (same argument parser, same ``init_app_state``)."""
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from replicas.engine_metrics import ray_stat_logger
    from replicas.engine_stats import EngineLoad, recorder_factory

    events = kv_event_socket(config)
    extra_cli = ["--kv-events-config", json.dumps(events.engine_config())] if events else []
    args, engine_args, vllm_config = engine_config(config, extra_cli)
    load = EngineLoad()
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        # vLLM's own metrics (queue, KV cache, prefix cache, tokens, latencies)
        # through Ray's metrics system, as Ray Serve LLM does: every node's Ray
        # metrics endpoint serves them, labelled per replica; by default
        # without the one histogram observed per token (engine_metrics.py).
        stat_loggers=[recorder_factory(load), ray_stat_logger(config.inter_token_latency_histogram)],
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    state = State()
    await init_app_state(engine, state, args, supported_tasks=await engine.get_supported_tasks())
    # Every prompt any handler renders counts against its request's allowance
    # (replicas/prompt_allowance.py): the gateway's reservation bounds it.
    from vllm.renderers.inputs.preprocess import extract_prompt_len

    prompt_length = functools.partial(extract_prompt_len, vllm_config.model_config)
    enforce_on(engine.renderer, prompt_length)
    guard_the_door(engine, prompt_length)
    return EngineBinding(
        engine=engine,
        load=load,
        max_model_len=vllm_config.model_config.max_model_len,
        endpoints=endpoints(state),
        serving_models=state.openai_serving_models,
        # Only a model with a reasoning parser ever carries `reasoning`.
        reasons=bool(getattr(args, "reasoning_parser", None)),
        reasoning_start=reasoning_start_tag(getattr(args, "reasoning_parser", None)),
        error_from=create_error_response,
        facts=placement_facts(vllm_config),
        kv_events=events,
    )


def kv_event_socket(config: ModelConfig) -> EventSocket | None:
    """Where the engine publishes its KV-cache events for the replica to tell the routers
    what it holds (replicas/kv_events.py): only a model routed by what replicas hold
    needs them, and one whose engine options publish elsewhere keeps its own."""
    if config.routing.policy != "cache_affinity" or "kv_events_config" in config.engine_kwargs:
        return None
    return EventSocket()


NO_MEDIA_DOMAIN = "media-fetching-is-off.invalid"


# A media URL that redirects could lead vLLM's fetch off the allowed domains.
MEDIA_ENV = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}

# vLLM 0.32's AOT compile cache (its default with torch >= 2.10) is written but never
# loads on the CPU build with torch 2.13 ("'function' object has no attribute
# 'finalize_loading'", vllm/compilation/decorators.py), so every engine start compiled
# again. Without it vLLM uses its earlier cache (Inductor's artifacts, same directory),
# which loads: engine init 15.5 s warm instead of 34-52 s (docs/performance.md, "Engine
# starts"). GPU builds keep vLLM's default.
CPU_COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def compile_env(config: ModelConfig) -> dict[str, str]:
    """The environment vLLM's compilation needs for ``config``'s engine (a bare
    ``vllm serve`` compared with the stack gets it too)."""
    return dict(CPU_COMPILE_ENV) if config.accelerator == "cpu" else {}


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
    if "enable_prompt_tokens_details" not in config.engine_kwargs:
        # Usage names the prompt tokens found in the prefix cache: a model's cached-prompt
        # price charges them (serve_app/accounting/costs.py), the usage API counts them.
        argv.append("--enable-prompt-tokens-details")
    if config.lora is not None:
        argv += [
            "--enable-lora",
            "--max-loras",
            str(config.lora.max_adapters_per_replica),
            "--max-lora-rank",
            str(config.lora.max_rank),
        ]
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


def endpoints(state) -> dict[str, tuple[Any, frozenset[str], Any]]:
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
        found["chat"] = (
            TypeAdapter(ChatCompletionRequest),
            field_names(ChatCompletionRequest),
            chat.create_chat_completion,
        )
    completion = getattr(state, "openai_serving_completion", None)
    if completion is not None:
        found["completions"] = (
            TypeAdapter(CompletionRequest),
            field_names(CompletionRequest),
            completion.create_completion,
        )
    embedding = getattr(state, "serving_embedding", None)
    if embedding is not None:
        found["embeddings"] = (TypeAdapter(EmbeddingRequest), field_names(EmbeddingRequest), embedding)
    responses = getattr(state, "openai_serving_responses", None)
    if responses is not None:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        found["responses"] = (TypeAdapter(ResponsesRequest), field_names(ResponsesRequest), responses.create_responses)
    messages = getattr(state, "anthropic_serving_messages", None)
    if messages is not None:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

        found["messages"] = (
            TypeAdapter(AnthropicMessagesRequest),
            field_names(AnthropicMessagesRequest),
            messages.create_messages,
        )
        found["count_tokens"] = (
            TypeAdapter(AnthropicCountTokensRequest),
            field_names(AnthropicCountTokensRequest),
            messages.count_tokens,
        )
    scores = getattr(state, "serving_scores", None)
    if scores is not None:
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

        found["score"] = (TypeAdapter(ScoreRequest), field_names(ScoreRequest), scores)
        found["rerank"] = (TypeAdapter(RerankRequest), field_names(RerankRequest), scores)
    tokenization = getattr(state, "serving_tokenization", None)
    if tokenization is not None:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        found["tokenize"] = (
            TypeAdapter(TokenizeRequest),
            field_names(TokenizeRequest),
            lambda request: tokenization.create_tokenize(request, None),
        )
        found["detokenize"] = (
            TypeAdapter(DetokenizeRequest),
            field_names(DetokenizeRequest),
            lambda request: tokenization.create_detokenize(request, None),
        )
        if chat is not None and completion is not None:
            found["templated_completions"] = (
                found["completions"][0],
                found["completions"][1],
                _templated(tokenization, completion.create_completion),
            )
    assert found.keys() <= REPLICA_OPERATIONS, found.keys() - REPLICA_OPERATIONS  # contract/replica_wire.py names each
    return found


def _templated(tokenization, complete):
    """A completions handler whose text prompts are each rendered as one user
    message through the model's chat template first (by vLLM's own tokenize
    path, the template chat uses), then completed as token ids: one choice per
    prompt, indexed by prompt, streamed and counted as any completion."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    async def handler(request):
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            return tokenization.create_error_response(
                "Prompts sent through the chat template must be text.", param="prompt"
            )
        rendered = []
        for prompt in prompts:
            with uncounted():  # rendered to be tokenized only: the ids are counted when completed
                tokens = await tokenization.create_tokenize(
                    TokenizeChatRequest(model=request.model, messages=[{"role": "user", "content": prompt}]), None
                )
            if is_error(tokens):
                return tokens
            rendered.append(tokens.tokens)
        return await complete(request.model_copy(update={"prompt": rendered}))

    return handler


def field_names(request_type: Any) -> frozenset[str]:
    """Field names (and aliases) of a pydantic model, or of every model in an
    ``Annotated[Union[...]]`` such as vLLM's EmbeddingRequest."""
    import typing

    if hasattr(request_type, "model_fields"):
        names = set(request_type.model_fields)
        names |= {field.alias for field in request_type.model_fields.values() if field.alias}
        return frozenset(names)
    names = set()
    for member in typing.get_args(request_type):
        names |= field_names(member)
    return frozenset(names)
