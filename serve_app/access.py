"""Who may send a request, whether it is admitted now, and what it cost.

One ``Access`` per ingress replica wraps the key store and the admission
scripts with what the hot path needs: a short key cache (a revoked key stops
working within ``key_cache_ttl_s``), OpenAI-style refusals, fire-and-forget
bookkeeping that never delays a response, and the Redis-down behaviour that
``fail_mode`` chooses.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from dataclasses import dataclass, field

import redis.asyncio
from redis.exceptions import RedisError

from serve_app.admission import REFUSALS, Admission, Decision
from serve_app.api_requests import COMPLETIONS_DEFAULT_MAX_TOKENS, Operation
from serve_app.errors import OpenAIError
from serve_app.keys import KeyRecord, KeyStore, digest
from serve_app.local_limits import LocalLimiter
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry
from serve_app.usage import new_request_id

logger = logging.getLogger("ray.serve")

REDIS_DOWN_RETRY_S = 1


@dataclass
class Ticket:
    """An admitted request: what settling it needs, and its response headers."""

    key: KeyRecord
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)
    local: bool = False  # admitted by the local fallback, not by Redis


class Access:
    def __init__(self, settings: AppSettings, telemetry: Telemetry):
        self.telemetry = telemetry
        quota = settings.quota
        self.redis = redis.asyncio.Redis.from_url(
            settings.redis_url,
            socket_timeout=quota.redis_timeout_s,
            socket_connect_timeout=quota.redis_timeout_s,
        )
        self.keys = KeyStore(self.redis)
        self.admission = Admission(
            self.redis, lease_s=quota.concurrency_lease_s, retention_s=quota.request_retention_s
        )
        self.cache_ttl_s = quota.key_cache_ttl_s
        self.fail_open = quota.fail_mode == "open"
        self.default_max_tokens = quota.default_max_tokens
        replicas = settings.ingress.deployment.get("num_replicas", 1)
        self.local = LocalLimiter(replicas if isinstance(replicas, int) else 1)
        self.admin_token = settings.admin_token.get_secret_value() if settings.admin_token else None
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        self._background: set[asyncio.Task] = set()

    # -- authentication ------------------------------------------------------

    async def authenticate(self, headers) -> KeyRecord:
        secret = _secret_from(headers)
        if not secret:
            raise OpenAIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' or 'api-key: <key>'.",
                code="invalid_api_key",
            )
        hashed = digest(secret)
        cached = self._cache.get(hashed)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            record = cached[1]
        else:
            try:
                record = await self.keys.authenticate(secret)
            except (RedisError, OSError) as exc:
                self.telemetry.redis_failed("authenticate")
                record = self._stale_or_unavailable(cached, exc)
            self._cache[hashed] = (now + self.cache_ttl_s, record)
        if record is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return record

    def _stale_or_unavailable(self, cached, exc) -> KeyRecord | None:
        if self.fail_open and cached is not None and cached[1] is not None:
            logger.warning("Redis unreachable (%s): using the cached key record", type(exc).__name__)
            self.telemetry.fell_back("cached_key")
            return cached[1]
        raise _unavailable(exc)

    def check_admin(self, headers) -> None:
        secret = _secret_from(headers)
        if self.admin_token is None or not secret or not hmac.compare_digest(secret, self.admin_token):
            raise OpenAIError(401, "Admin API: invalid or missing admin token.", code="invalid_api_key")

    @staticmethod
    def authorize(key: KeyRecord, model: str) -> None:
        if not key.allows_model(model):
            raise OpenAIError(
                403, f"This API key may not use model '{model}'.", param="model", code="model_not_allowed"
            )

    # -- admission -------------------------------------------------------------

    def reserve_tokens(self, operation: Operation, body: dict, raw_size: int) -> int:
        """Tokens to reserve before generation: the prompt (estimated at 4 bytes
        per token of the request body, which over- rather than under-counts)
        plus the completion budget of every choice."""
        prompt = math.ceil(raw_size / 4)
        if not operation.generates:
            return prompt
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if operation.name == "completions" else self.default_max_tokens
        completion = body.get("max_completion_tokens") or body.get("max_tokens") or default
        n = body.get("n") or 1
        if not isinstance(completion, int) or not isinstance(n, int):
            completion, n = default, 1  # vLLM rejects these; reserve a default meanwhile
        return prompt + max(completion, 0) * max(n, 1)

    async def admit(self, key: KeyRecord, model: str, reserve_tokens: int, http_request_id: str = "") -> Ticket:
        request_id = new_request_id(key.id)
        started = time.perf_counter()
        try:
            decision = await self.admission.admit(key, request_id, model, reserve_tokens, http_request_id)
        except (RedisError, OSError) as exc:
            self.telemetry.redis_failed("admit")
            return self._admit_locally(key, request_id, reserve_tokens, exc)
        self.telemetry.admission_took(time.perf_counter() - started)
        self._record_budget_use(key, decision)
        headers = decision.headers(key)
        if not decision.admitted:
            raise _refusal(key, decision, reserve_tokens, headers)
        return Ticket(key, request_id, headers)

    def _record_budget_use(self, key: KeyRecord, decision: Decision) -> None:
        budgets = {"daily": key.daily_token_budget, "monthly": key.monthly_token_budget}
        used = decision.budget_used()
        if decision.kind in ("daily_budget", "monthly_budget"):  # refused: detail = that period's use
            used = {decision.kind.split("_")[0]: int(decision.detail)}
        for period, tokens in used.items():
            self.telemetry.budget_used(key.name, period, tokens, budgets[period])

    def _admit_locally(self, key: KeyRecord, request_id: str, reserve_tokens: int, exc) -> Ticket:
        if not self.fail_open:
            raise _unavailable(exc)
        self.telemetry.fell_back("local_limits")
        logger.warning("Redis unreachable (%s): admitting on local limits", type(exc).__name__)
        admitted, kind, retry_s = self.local.admit(key, request_id, reserve_tokens)
        if not admitted:
            kind_type, code = REFUSALS[kind]
            raise OpenAIError(
                429,
                f"Rate limit reached for {kind_type} on API key '{key.name}'. Please try again in {retry_s:.1f}s.",
                type=kind_type,
                code=code,
                headers={"retry-after": str(math.ceil(retry_s)), "retry-after-ms": str(math.ceil(retry_s * 1000))},
            )
        return Ticket(key, request_id, {}, local=True)

    # -- bookkeeping off the response path ------------------------------------

    def running(self, ticket: Ticket, replica: str = "") -> None:
        if not ticket.local:
            self._spawn(self.admission.running(ticket.key.id, ticket.request_id, replica))

    def settle(self, ticket: Ticket, status: str, usage: dict | None = None, replica: str = "") -> None:
        """``usage`` None keeps the whole reservation charged (e.g. a stream the
        client cancelled: tokens were made but never counted)."""
        if ticket.local:
            self.local.release(ticket.key.id, ticket.request_id)
            return
        prompt = completion = -1
        if usage is not None:
            prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
        self._spawn(
            self.admission.settle(ticket.key, ticket.request_id, status, prompt, completion, replica)
        )

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(self._logged(coroutine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _logged(self, coroutine) -> None:
        try:
            await coroutine
        except (RedisError, OSError) as exc:
            # The lease expires and the reservation stays charged: safe, if strict.
            self.telemetry.redis_failed("accounting")
            logger.warning("Redis unreachable while accounting a request: %s", type(exc).__name__)


def _secret_from(headers) -> str | None:
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("api-key") or None


def _unavailable(exc) -> OpenAIError:
    return OpenAIError(
        503,
        "The service cannot check quotas right now. Please retry shortly.",
        code="quota_backend_unavailable",
        headers={"retry-after": str(REDIS_DOWN_RETRY_S), "retry-after-ms": str(REDIS_DOWN_RETRY_S * 1000)},
    )


def _refusal(key: KeyRecord, decision: Decision, reserved: int, headers: dict[str, str]) -> OpenAIError:
    kind_type, code = REFUSALS[decision.kind]
    limit = {
        "requests": f"{key.requests_per_minute} requests per minute",
        "tokens": f"{key.tokens_per_minute} tokens per minute",
        "tokens_too_large": f"{key.tokens_per_minute} tokens per minute",
        "concurrency": f"{key.max_concurrent} concurrent requests",
        "daily_budget": f"a daily budget of {key.daily_token_budget} tokens",
        "monthly_budget": f"a monthly budget of {key.monthly_token_budget} tokens",
    }[decision.kind]
    if decision.kind == "tokens_too_large":
        message = (
            f"Request too large for API key '{key.name}': it needs up to {reserved} tokens "
            f"(prompt estimate plus max_tokens × n) and the limit is {limit}. Lower max_tokens."
        )
    elif decision.kind.endswith("_budget"):
        message = (
            f"You exceeded your token quota on API key '{key.name}' ({limit}; used {decision.detail}, "
            f"this request reserves {reserved}). It renews in {decision.retry_ms / 1000:.0f}s."
        )
    elif decision.kind == "concurrency":
        message = (
            f"Rate limit reached for concurrent requests on API key '{key.name}': limit {limit}, "
            f"running {decision.detail}. Please try again when one finishes."
        )
    else:
        quota, remaining, requested = (
            (key.requests_per_minute, decision.requests_remaining, 1)
            if decision.kind == "requests"
            else (key.tokens_per_minute, decision.tokens_remaining, reserved)
        )
        message = (
            f"Rate limit reached for {kind_type} on API key '{key.name}': limit {limit}, "
            f"used {quota - max(remaining, 0)}, requested {requested}. "
            f"Please try again in {decision.retry_ms / 1000:.3g}s."
        )
    return OpenAIError(429, message, type=kind_type, code=code, headers=headers)
