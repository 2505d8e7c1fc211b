"""Typed settings of the gateway application.

One object, read from the Serve config's ``args`` (``build_app``) and from
``LLM_CLUSTER_*`` environment variables; the defaults serve the local run.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract.model_config import ModelConfig
from contract.tracing import TRACES_SAMPLE_RATIO_ENV
from serve_app.limits import KeyLimits
from serve_app.redis_store import redis_client

# The bootstrap admin token's shortest length (32 hex characters: 128 bits).
MIN_ADMIN_TOKEN_CHARS = 32


class IngressConfig(BaseModel):
    """The HTTP front: body limits and the ingress deployment's Serve options."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 * 1024 * 1024, description="Requests larger than this get 413 before parsing.")
    room_check_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="An inference request whose body is declared larger than this, or declares no length, "
        "is checked against its key's requests/min and concurrency in Redis before its body is read "
        "(one round trip, charging nothing: serve_app/admission/lua/room.lua): a key at those limits gets "
        "its 429 before the gateway reads or parses a byte. Smaller bodies take about 0.3 ms to parse "
        "(256 KiB) and are refused by the admission that follows. 0: every request is checked first.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A request body (not a file upload: that holds one of its key's concurrency "
        "slots) must arrive whole within this, else 408. HAProxy gives the headers 10 s, and "
        "the first 256 KiB of a body it reads to send the request to a model's direct route "
        "in one hop the same 10 s (cluster/haproxy_edge.py).",
    )
    deployment: dict[str, Any] = Field(
        default_factory=lambda: {
            "num_replicas": 1,
            "max_ongoing_requests": 256,
            "ray_actor_options": {"num_cpus": 0.25},
        },
        description="Ray Serve options of the ingress deployment.",
    )


class QuotaConfig(BaseModel):
    """How keys and quotas are enforced (docs/quotas.md, "Keys and quotas")."""

    model_config = ConfigDict(extra="forbid")

    key_cache_ttl_s: float = Field(
        5.0, ge=0, description="Ingress caches key records this long: a revoked key stops within it."
    )
    key_cache_max: int = Field(
        10_000,
        gt=0,
        description="Key records an ingress caches at most (least recently used go first).",
    )
    key_stale_max_s: float = Field(
        300.0,
        ge=0,
        description="While Redis is unreachable, a cached key authenticates only if Redis "
        "confirmed it within this long (fail_mode open); older ones get 503.",
    )
    concurrency_lease_s: float = Field(
        60.0,
        gt=0,
        description="A concurrency slot expires after this unless its ingress renews it "
        "(every third of it while the request runs): an ingress that died holds a key's slots this long at most.",
    )
    request_retention_s: int = Field(7 * 86400, gt=0, description="How long request records are kept.")
    default_max_tokens: int = Field(
        1024,
        gt=0,
        description="max_tokens set on a chat request that names none (never beyond the "
        "model's context); what it reserves.",
    )
    fail_mode: Literal["open", "closed"] = Field(
        "open", description="Redis unreachable: open = serve with local approximate limits; closed = 503."
    )
    redis_timeout_s: float = Field(
        0.5, gt=0, description="Per-command Redis timeout; past it Redis counts as unreachable (fail_mode)."
    )
    shed_loop_lag_s: float = Field(
        5.0,
        ge=0,
        description="An ingress (or a direct route's replica) whose event loop runs this many seconds late "
        "refuses new requests with 503 gateway_overloaded and retry-after until it catches up: the work it "
        "holds drains instead of growing until Serve's health check (30 s unanswered) replaces the replica "
        'and every request on it fails (docs/quotas.md, "An overloaded ingress is not a Redis outage"). 0: never.',
    )
    replicas_to_acknowledge: int = Field(
        0,
        ge=0,
        le=16,
        description="Admissions, settlements and lease renewals count as written only once "
        "this many replicas of their primary acknowledge them (Redis WAIT, once per pipeline): a failover then "
        "loses none. Past replica_ack_timeout_ms, Redis counts as unreachable (fail_mode). 0: Redis' "
        'asynchronous replication (docs/quotas.md, "When a primary dies").',
    )
    replica_ack_timeout_ms: int = Field(
        100,
        gt=0,
        description="How long an admission waits for replicas_to_acknowledge replicas.",
    )
    overlap_admission: bool = Field(
        True,
        description="On a model's direct route, while the model is busy, a stream of a key Redis last "
        "admitted with room to spare "
        "starts in the engine while its admission is in Redis (nothing is sent before Redis admits it; a "
        "refusal aborts it): the Redis round trip leaves the time to first token. Bounded per key by the room "
        "Redis last reported (serve_app/admission/overlap.py); a prompt admitted again at its real size (denser "
        "than its estimate) always waits for its admission. false: every request waits for its admission first.",
    )
    overlap_admission_when_idle: bool = Field(
        True,
        description="overlap_admission on an idle model too (its first request, not only those arriving "
        "while others run): the round trip leaves the time to first token of a lone stream as well. It wants a "
        "Redis that gets a core while the engine computes: on its own host, or on the engine's in the real-time "
        "class (scripts/ensure_redis.sh starts it so); a Redis in the normal class on the engine's cores answered "
        "in ~100 ms there (docs/performance.md). false: on an idle model admission goes first.",
    )


class TracingConfig(BaseModel):
    """OpenTelemetry traces (docs/operating.md, "Traces"; serve_app/tracing.py)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (an OpenTelemetry collector, Jaeger or Tempo), e.g. "
        "http://collector:4318/v1/traces. Unset: no traces (nothing is recorded or sent).",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of requests traced when the client sent no traceparent; a client's sampled "
        "flag is followed (parent-based sampling).",
    )

    def env(self, service: str) -> dict[str, str]:
        """The OpenTelemetry SDK's standard variables for a process of ``service``
        (every deployment's replicas get them): the SDK reads its exporter and
        service name from them, so the gateway and the replicas are configured alike.

        Only the gateway starts traces: its tracer samples a request with no sampled
        parent at ``sample_ratio`` (serve_app/tracing.py reads it from
        ``TRACES_SAMPLE_RATIO_ENV``). Every other tracer built from these variables
        (the replica's, vLLM's engine and loading spans) records a span only under a
        sampled parent (``parentbased_always_off``): a request the gateway did not
        sample hands vLLM no context, and vLLM's tracer would otherwise start a trace
        of its own at the ratio, an orphan engine span."""
        if not self.endpoint:
            return {}
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",
            TRACES_SAMPLE_RATIO_ENV: str(self.sample_ratio),
            "OTEL_SERVICE_NAME": service,
        }


class TelemetryConfig(BaseModel):
    """Metrics, access log and traces (docs/operating.md, "Metrics and logs")."""

    model_config = ConfigDict(extra="forbid")

    per_key_metrics: bool = Field(
        True,
        description="Label request, token and budget metrics by API key name (the quota "
        "dashboard's top-key panels), for at most per_key_max_keys keys per ingress replica.",
    )
    per_key_max_keys: int = Field(
        100,
        ge=1,
        le=10_000,
        description="Key names an ingress replica labels metrics with: the first this many it "
        "sees; later keys count together as '(other keys)', so minted keys cannot grow the "
        "series without bound. Team names (the team metrics, always on) are bounded the same "
        "way, under '(other teams)'. Exact per-key usage is in Redis (`llmctl usage`).",
    )
    access_log: bool = Field(True, description="One JSON line per request on the ingress's stdout.")
    tracing: TracingConfig = Field(default_factory=TracingConfig)


class BatchConfig(BaseModel):
    """OpenAI's Files and Batch API (docs/api.md, "Batch API"; serve_app/stored/batch_runner.py)."""

    model_config = ConfigDict(extra="forbid")

    files_dir: str = Field(
        "~/.llm-cluster/files",
        description="Where uploaded files and batch outputs are kept (their metadata is in Redis). Every "
        "ingress node must see the same directory: on a cluster, a shared mount (NFS, EFS, Filestore, a "
        "FUSE-mounted bucket). A batch's partial results are written here too, which is what lets another "
        "ingress resume it.",
    )
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0, description="Largest upload (OpenAI's: 200 MB).")
    max_bytes_per_key: int = Field(
        10 * 1024**3,
        gt=0,
        description="Bytes one key's files may hold at once (uploads and batch results; "
        "OpenAI's: 2.5 TB per project). Every key shares files_dir's disk: an upload that would pass this is a "
        "400 before a byte is written, so no key can fill the disk for the others. Size the disk for the keys "
        "that run batches, or lower this.",
    )
    max_files_per_key: int = Field(
        10_000, gt=0, description="Files one key may hold at once (bounds its metadata in Redis)."
    )
    max_requests: int = Field(50_000, gt=0, description="Requests one batch file may hold (OpenAI's: 50,000).")
    max_active_per_key: int = Field(
        100,
        gt=0,
        description="Batches of one key not ended yet (validating, in progress, cancelling); one more "
        "is a 429 too_many_active_batches before its file is read.",
    )
    batches_at_once: int = Field(
        4,
        ge=1,
        description="Batches an ingress replica runs side by side (of any keys). A batch that cannot "
        "proceed (its key refused: a limit, a budget) is parked and holds no place.",
    )
    batches_per_key: int = Field(
        1,
        ge=1,
        description="Of those, batches of one key at most: a key with many batches takes this many "
        "places per ingress replica; the others go to other keys' batches.",
    )
    concurrency: int = Field(
        4,
        ge=1,
        description="Requests of one batch an ingress replica runs at once. Each is sent only while "
        "no interactive request of its model waits at that ingress, at an engine priority below every "
        "key's tier: batches fill idle capacity and yield to interactive traffic.",
    )
    lease_s: float = Field(
        15.0,
        gt=0,
        description="A batch is run by one ingress replica at a time, under a lease it renews; "
        "if that replica dies, another resumes the batch this long after.",
    )
    poll_s: float = Field(1.0, gt=0, description="How often an idle ingress replica looks for a batch to run.")
    reconcile_s: float = Field(
        300.0,
        gt=0,
        description="How often one ingress replica (of all) rebuilds the runners' set of batches from each key's "
        "own, with a SCAN of Redis: a batch whose entry a Redis failover lost (or whose ingress died while "
        "creating it) runs within this.",
    )


class StoreConfig(BaseModel):
    """What one key may keep in Redis (docs/quotas.md, "Storage bounds"): its stored Responses API
    conversations and its batches' records, counted together in one account per key."""

    model_config = ConfigDict(extra="forbid")

    max_bytes_per_key: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Bytes one key's stored responses and batch records may hold in "
        "Redis. A response that would pass it is refused (400 storage_limit_exceeded) before it runs, unless "
        "sent with store: false; a batch, before its file is read. Redis is shared by every key and runs "
        "with noeviction: a full Redis refuses every admission.",
    )
    max_objects_per_key: int = Field(
        10_000,
        gt=0,
        description="Stored responses and batch records one key may hold at once.",
    )


class RecordsConfig(BaseModel):
    """Where request records live (docs/operating.md, "Request records"): Redis keeps the
    requests in flight and the last ``recent_s`` of final records; every final record
    is appended to hourly JSONL files under ``sink_dir``, where ``llmctl requests show``
    and ``GET /admin/requests/{id}`` find it for ``quota.request_retention_s``."""

    model_config = ConfigDict(extra="forbid")

    sink_dir: str | None = Field(
        "~/.llm-cluster/records",
        description="The directory final request records are appended to (`<day>/<hour>/<writer>.jsonl`, "
        "kept quota.request_retention_s). Every ingress node must see the same directory, as batch.files_dir: "
        "on a cluster a shared mount. Unset (null): records stay in Redis for the whole retention.",
    )
    recent_s: int = Field(
        3600,
        gt=0,
        description="How long a final record stays in Redis too (the quick lookups of the last "
        "hour); Redis holds about this long of traffic instead of the whole retention.",
    )
    max_backlog: int = Field(
        100_000,
        gt=0,
        description="Final records waiting for the sink (a Redis stream) past which new "
        "requests are refused, 503 records_backlog, until the sink takes them: a sink that is down stops the "
        "service after this many requests rather than losing records or growing Redis without bound.",
    )


class JwtConfig(BaseModel):
    """Identity from the company's OIDC provider: ``Authorization: Bearer <JWT>``
    (serve_app/identity/jwt_auth.py). Each user (``user_claim``) is admitted with its own
    limits, exactly as a key is."""

    model_config = ConfigDict(extra="forbid")

    issuer: str = Field(description="The `iss` every token must carry (the provider's issuer URL).")
    audience: str = Field(description="The `aud` every token must name (this gateway's client id).")
    jwks_url: str = Field(description="Where the provider publishes its signing keys (JWKS), http(s).")
    algorithms: list[Literal["RS256", "RS384", "RS512", "ES256", "ES384", "PS256"]] = Field(
        ["RS256", "ES256"], min_length=1, description="Signature algorithms accepted (never `none` or HMAC)."
    )
    user_claim: str = Field("sub", description="The claim that names the user (`sub`, `email`): its limits' owner.")
    tier_claim: str | None = Field(None, description="A claim naming the user's priority tier (high|normal|low).")
    models_claim: str | None = Field(
        None, description="A claim listing the models the user may use (within `limits.models`)."
    )
    team_claim: str | None = Field(
        None,
        description="A claim naming the user's group, or listing its groups: the first that `teams` maps "
        "makes the user a member of that team (admitted and charged as a key of it). Needs `teams`.",
    )
    teams: dict[str, str] = Field(
        default_factory=dict,
        description="`team_claim` values (the provider's groups) → team names. Only these map: a group "
        "value is never read as a team's name or id itself (anyone who may create a group in the provider "
        "would pick a team).",
    )
    unmapped_team: Literal["none", "refuse"] = Field(
        "none",
        description="A token none of whose `team_claim` values `teams` maps: `none` admits its user on its "
        "own limits, of no team; `refuse` answers 401.",
    )
    limits: KeyLimits = Field(default_factory=KeyLimits, description="Every user's limits, as a key's.")
    leeway_s: float = Field(30.0, ge=0, le=300, description="Clock skew allowed on `exp` and `nbf`.")
    jwks_cache_s: float = Field(
        300.0,
        gt=0,
        le=3600,
        description="How long fetched signing keys are trusted: a key the provider removes is refused by "
        "every process within this (plus one fetch) while the JWKS can be fetched.",
    )
    jwks_refresh_min_s: float = Field(
        30.0,
        ge=0,
        description="An unknown `kid` fetches the JWKS again at most this often (a flood of made-up kids cannot).",
    )
    jwks_timeout_s: float = Field(3.0, gt=0, description="A JWKS fetch gives up after this.")

    @field_validator("jwks_url")
    @classmethod
    def _web_url(cls, url: str) -> str:
        if not url.startswith(("https://", "http://")):
            raise ValueError("jwks_url must be an http(s) URL")
        return url

    @model_validator(mode="after")
    def _groups_map_explicitly(self):
        if self.team_claim is not None and not self.teams:
            raise ValueError("team_claim needs `teams`: the provider's group values mapped to team names")
        return self


class AuthConfig(BaseModel):
    """Who may send requests besides API keys."""

    model_config = ConfigDict(extra="forbid")

    jwt: JwtConfig | None = Field(None, description="Tokens of an OIDC provider; unset = API keys only.")
    admin_failures_per_minute: int = Field(
        20,
        ge=0,
        description="Failed admin credentials (admin API, console login) one client may send in a "
        "clock minute; past it that client's failures are a 429 (retry-after) instead of a 401 until the minute "
        "ends. A correct credential always passes; guessing is bounded by the credentials' entropy. 0 = no limit.",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR) of the load balancers in front of the edge: the client's address is the "
        "X-Forwarded-For entry the first proxy not listed added (the edge's own peer when empty).",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            ipaddress.ip_network(network)  # ValueError names it
        return networks


class AppSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_CLUSTER_", env_nested_delimiter="__", extra="forbid")

    models: list[ModelConfig] = Field(
        default_factory=lambda: [ModelConfig(name="tiny-llama")],
        description="The served models, one deployment each (below).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    quota: QuotaConfig = Field(default_factory=QuotaConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    records: RecordsConfig = Field(default_factory=RecordsConfig)
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("redis_url", "REDIS_URL"),
        description="One node, a Redis Cluster or a Sentinel's primary: serve_app/redis_store/redis_client.py.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="The /admin API's shared bootstrap token (LLM_CLUSTER_ADMIN_TOKEN); unset = only named "
        "admin credentials (`llmctl admins create`) are accepted.",
    )

    @field_validator("admin_token")
    @classmethod
    def _long_admin_token(cls, token: SecretStr | None) -> SecretStr | None:
        # Its length is what bounds guessing it: a correct credential is never throttled
        # (serve_app/identity/credential_guard.py).
        if token is not None and len(token.get_secret_value()) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"admin_token must be at least {MIN_ADMIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)"
            )
        return token

    @field_validator("redis_url")
    @classmethod
    def _known_redis_url(cls, url: str) -> str:
        redis_client.parse(url)  # ValueError names the problem
        return url

    @model_validator(mode="after")
    def _unique_names(self):
        names = [name for m in self.models for name in (m.name, *m.aliases, *(m.lora.adapters if m.lora else ()))]
        if len(names) != len(set(names)):
            raise ValueError(f"model names, aliases and adapter names must be unique, got {names}")
        if not names:
            raise ValueError("at least one model must be configured")
        return self
