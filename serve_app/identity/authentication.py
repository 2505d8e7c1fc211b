"""Who is calling: an API key, an identity token's user or an admin, each as a route needs it.

``Authenticator`` answers the key record behind a request's credential (through a
short cache: a revoked key stops working within ``key_cache_ttl_s``), the key as a
route that names models sees it (narrowed to its team's models), its team as
admission applies it, and the admin behind an admin credential. While Redis is
unreachable a record Redis confirmed within ``key_stale_max_s`` stands in
(``fail_mode`` open), or the caller gets a 503; any other Redis error is a 503
``quota_backend_error`` (docs/quotas.md, "Keys and quotas").
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token

from serve_app.errors import OpenAIError, gateway_overloaded, quota_store_error, quota_store_unavailable, unknown_model
from serve_app.identity.admins import ADMIN_TOKEN_ACTOR, AdminStore
from serve_app.identity.admins import SECRET_PREFIX as ADMIN_SECRET_PREFIX
from serve_app.identity.credential_guard import CredentialGuard
from serve_app.identity.jwt_auth import JwtAuthenticator, looks_like_jwt
from serve_app.identity.key_cache import KeyCache
from serve_app.identity.keys import SECRET_PREFIX as KEY_SECRET_PREFIX
from serve_app.identity.keys import KeyRecord, KeyStore, digest
from serve_app.identity.teams import TeamNotFound, TeamRecord, TeamStore
from serve_app.redis_store.redis_client import REDIS_FAILED, UNREACHABLE
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

logger = logging.getLogger("ray.serve")

# What the current request's credential was found to be ("key" or "admin"), once checked:
# a route declared for keys answers only if its handler checked one
# (serve_app/http/route_access.py). A context variable: each request runs in its own task.
_CHECKED: ContextVar[str | None] = ContextVar("credential_checked", default=None)


def start_credential_check() -> Token:
    """Forget any earlier check in this context (the route's guard calls it first)."""
    return _CHECKED.set(None)


def credential_checked() -> str | None:
    """ "key" or "admin" once this request's credential was checked, else None."""
    return _CHECKED.get()


def reset_credential_checked(token: Token) -> None:
    _CHECKED.reset(token)


def authorize(key: KeyRecord, model: str, asked: str | None = None) -> None:
    """The 404 of a model that does not exist unless ``key`` may use ``model`` (a configured
    name; ``asked``: the name the client sent, which the answer names); its team's models
    are ``Gateway.run``'s check."""
    if not key.allows_model(model):
        raise unknown_model(asked or model)


def secret_from(headers: Mapping[str, str]) -> str | None:
    """The credential a request carries: a bearer token, else Azure's ``api-key`` or
    Anthropic's ``x-api-key`` header (its SDK sends the key nowhere else)."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("api-key") or headers.get("x-api-key") or None


class Authenticator:
    def __init__(
        self,
        keys: KeyStore,
        teams: TeamStore,
        admins: AdminStore,
        settings: AppSettings,
        telemetry: Telemetry,
        late_during: Callable[[float], bool] = lambda since: False,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``late_during(since)``: whether this process' loop ran so late since ``since``
        (``clock``) that a Redis call failing meanwhile is its own overload
        (admission/loop_lag.py): a key look-up that failed so is shed (503
        gateway_overloaded, retry-after), not refused as if Redis were down."""
        quota, auth = settings.quota, settings.auth
        self.late_during, self.clock = late_during, clock
        self.keys, self.teams, self.admins = keys, teams, admins
        self.telemetry = telemetry
        self.fail_open = quota.fail_mode == "open"
        self.credential_guard = CredentialGuard(keys.redis, auth.admin_failures_per_minute, auth.trusted_proxies)
        # Tokens of the company's identity provider, besides API keys (jwt_auth.py).
        self.jwt = JwtAuthenticator(auth.jwt) if auth.jwt is not None else None
        self.admin_token = settings.admin_token.get_secret_value() if settings.admin_token else None
        self._cache: KeyCache[KeyRecord] = KeyCache(quota.key_cache_ttl_s, quota.key_stale_max_s, quota.key_cache_max)
        # Team records by id (or an identity token's team name), cached as key records are:
        # a disabled team stops its keys as fast as a revoked key stops.
        self._team_cache: KeyCache[TeamRecord] = KeyCache(
            quota.key_cache_ttl_s, quota.key_stale_max_s, quota.key_cache_max
        )

    async def authenticate(self, headers: Mapping[str, str], seen: dict[str, str] | None = None) -> KeyRecord:
        """The caller's key record, or a 401/503. ``seen["source"]`` says where it came
        from (a trace's attribute): ``cache``, ``redis``, ``stale_cache`` (Redis
        unreachable) or ``identity_token``."""
        seen = {} if seen is None else seen
        secret = secret_from(headers)
        if not secret:
            raise OpenAIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>', 'api-key: <key>' or "
                "'x-api-key: <key>'.",
                code="invalid_api_key",
            )
        if self.jwt is not None and looks_like_jwt(secret):
            seen["source"] = "identity_token"
            user = await self.jwt.authenticate(secret)  # checked in memory: no Redis, no cache
            _CHECKED.set("key")
            return user
        hashed = digest(secret)
        hit, record = self._cache.get(hashed)
        seen["source"] = "cache"
        if not hit:
            seen["source"] = "redis"
            called_at = self.clock()
            try:
                record = await self.keys.authenticate(secret)
            except UNREACHABLE as exc:
                self.telemetry.redis_failed("authenticate")
                record = self._fallback(hashed, exc, called_at)
                seen["source"] = "stale_cache"
            except REDIS_FAILED as exc:
                self.telemetry.redis_failed("authenticate")
                logger.error("Redis refused to look a key up: %r", exc)
                raise quota_store_error() from None
            else:
                self._cache.put(hashed, record)
        if record is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        _CHECKED.set("key")
        return record

    async def tenant(self, headers: Mapping[str, str]) -> KeyRecord:
        """The caller's key as a route that names models sees it: a 401 for a revoked
        key or a disabled team (``team_of``), and its models narrowed to those its
        team allows too, so a listing, a card or a dialect's default model never
        names one it may not use."""
        key = await self.authenticate(headers)
        team = await self.team_of(key)
        if team is None or team.models is None:
            return key
        allowed = [model for model in team.models if key.allows_model(model)]
        return key.model_copy(update={"models": allowed})

    def _fallback(self, hashed: str, exc: Exception, called_at: float) -> KeyRecord:
        """A key record to stand in while Redis is unreachable (fail_mode open):
        one Redis confirmed within ``key_stale_max_s``, or a 503: the process' own
        overload (shed, as admission does) if its loop ran late during the call, else
        Redis unavailable. (The soak: a replica at cold start, its loop 0.7 s late, told
        its first clients the quota store was down.)"""
        record = self._cache.fallback(hashed) if self.fail_open else None
        if record is None:
            raise self._unreachable(called_at)
        logger.warning("Redis unreachable (%s): using the cached key record", type(exc).__name__)
        self.telemetry.fell_back("cached_key")
        return record

    def _unreachable(self, called_at: float) -> OpenAIError:
        """The 503 for a look-up begun at ``called_at`` that found Redis unreachable and
        nothing cached to stand in: this process' own overload (shed, as admission
        does) if its loop ran late meanwhile, else the quota store unavailable."""
        if self.late_during(called_at):
            self.telemetry.fell_back("shed_overloaded")
            return gateway_overloaded()
        return quota_store_unavailable()

    async def admin_actor(self, headers: Mapping[str, str]) -> str:
        """Who is calling the admin API (the audit trail's actor: ``admin-token`` for
        the shared bootstrap token, ``admin:<name>`` for a named credential), or 401."""
        secret = secret_from(headers)
        if secret and (secret.startswith(KEY_SECRET_PREFIX) or looks_like_jwt(secret)):
            # A tenant's credential on an admin route: no admin credential's guess, so not
            # counted as one (else a tenant's keys sent here would throttle its admins).
            raise OpenAIError(
                401, "Admin API: an API key or identity token is not an admin credential.", code="invalid_api_key"
            )
        # A correct admin credential is always checked and always passes, whatever others
        # sent from the same address (one address for every client behind a load balancer
        # or NAT): guessing is bounded by the secrets' entropy (credential_guard.py), and
        # the throttle only answers a client's failures.
        # As bytes: compare_digest refuses str with non-ASCII characters (a header may carry any).
        if (
            self.admin_token is not None
            and secret
            and hmac.compare_digest(secret.encode("utf-8", "surrogateescape"), self.admin_token.encode("utf-8"))
        ):
            _CHECKED.set("admin")
            return ADMIN_TOKEN_ACTOR
        admin = None
        if secret and secret.startswith(ADMIN_SECRET_PREFIX):
            called_at = self.clock()
            try:
                admin = await self.admins.authenticate(secret)
            except UNREACHABLE:
                self.telemetry.redis_failed("authenticate")
                raise self._unreachable(called_at) from None
            except REDIS_FAILED:
                self.telemetry.redis_failed("authenticate")
                raise quota_store_error() from None
        if admin is None:
            if secret:
                await self.credential_guard.failed(headers)  # a 429 once this client failed too often
            raise OpenAIError(401, "Admin API: invalid or missing admin credential.", code="invalid_api_key")
        _CHECKED.set("admin")
        return f"admin:{admin.name}"

    async def team_of(self, key: KeyRecord, model: str = "") -> TeamRecord | None:
        """The key's team as admission applies it (cached for ``key_cache_ttl_s``), or
        None for a key without one. A team disabled or gone refuses its keys (401);
        a model the team may not use, 403. While Redis is unreachable, a record it
        confirmed within ``key_stale_max_s`` stands in (fail_mode open), or a 503."""
        if key.team is None:
            return None
        hit, team = self._team_cache.get(key.team)
        if not hit:
            called_at = self.clock()
            try:
                # By id (a key's), or by name (an identity token's team claim, jwt_auth.py).
                team = await self.teams.resolve(key.team)
            except TeamNotFound:
                team = None
            except UNREACHABLE:
                self.telemetry.redis_failed("authenticate")
                team = self._team_cache.fallback(key.team) if self.fail_open else None
                if team is None:
                    raise self._unreachable(called_at) from None
            except REDIS_FAILED:
                self.telemetry.redis_failed("authenticate")
                raise quota_store_error() from None
            else:
                self._team_cache.put(key.team, team)
        if team is None or not team.enabled:
            raise OpenAIError(
                401, f"The team of API key '{key.name}' is disabled or does not exist.", code="team_disabled"
            )
        if model and not team.allows_model(model):
            raise OpenAIError(
                403,
                f"The team '{team.name}' of this API key may not use model '{model}'.",
                param="model",
                code="model_not_allowed",
            )
        return team
