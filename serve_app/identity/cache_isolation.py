"""Whose requests share a model's prefix cache: each request's vLLM ``cache_salt``.

vLLM shares its prefix cache across every request an engine serves unless a request
carries a ``cache_salt`` (hashed into its first block, so blocks of two salts never
match). Shared across tenants, the cache is a timing side channel: a tenant learns
whether another's prompt (a system prompt, a document) is cached by timing its first
token on guesses (tests/e2e/shared_stack/test_cache_isolation_e2e.py plays it).

So the gateway, never the client, sets the salt: an HMAC, under a server secret no
client can read, of the tenant the isolation level names (``key``: the key;
``team``: its team, or the key when it has none; ``shared``: nobody) and of the
client's own ``cache_salt``, which thus only divides its tenant's cache (one
conversation kept apart from another of the same team) and can never reach another
tenant's. Under ``shared`` without a client salt the request carries none: every
tenant's cache is one. The level is the key's ``cache_isolation``, else its team's,
else the model's (contract/model_config.py).

The same salt names the request's blocks to the routers (contract/prompt_blocks.py
puts it before the prompt's text): one tenant's cached blocks never attract another
tenant's requests. A routing session (the client's session header, or OpenAI's
``prompt_cache_key``, a routing hint within a tenant: requests of one tenant naming
one session go to one replica while its load allows) is likewise a hash of the
session and the salt, or, for a request sharing everyone's cache, of a salt of its
team (else its key): two tenants' equal session ids are two sessions, so no tenant
can place its load on the replica of another's session it knows or guesses.

The secret lives in Redis (made once by the first process that needs it), so every
ingress and replica, and the edge router, salts alike. A process that cannot read it
(Redis down at its first request) salts with a secret of its own until it can:
isolation holds, only hits across processes are lost meanwhile.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from typing import Any

from contract.model_config import CacheIsolation, ModelConfig
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import REDIS_FAILED, as_text

logger = logging.getLogger("ray.serve")

# vLLM refuses a salt longer than 128 characters or holding '@', '/', '\' or NUL:
# 43 characters of URL-safe base64 (256 bits, vLLM's own advice) are none of those.
SALT_CHARS = 43
# A client's own salt is only hashed: any string up to this is taken, as vLLM's field takes it.
MAX_CLIENT_SALT_CHARS = 1024
MAX_PROMPT_CACHE_KEY_CHARS = 1024
# A routing session's kind, before its hash: a prompt_cache_key and a session header
# of one value are two sessions.
PROMPT_CACHE_SESSION = "prompt_cache_key\x00"
HEADER_SESSION = "session_header\x00"


def isolation_level(key: KeyRecord, team: TeamRecord | None, config: ModelConfig) -> CacheIsolation:
    """The key's level, else its team's, else the model's."""
    if key.cache_isolation is not None:
        return key.cache_isolation
    if team is not None and team.cache_isolation is not None:
        return team.cache_isolation
    return config.cache_isolation


def tenant_of(level: CacheIsolation, key: KeyRecord, team: TeamRecord | None) -> str:
    """Whose cache a request of ``key`` uses at ``level`` ('' when everyone's)."""
    if level == "shared":
        return ""
    if level == "team" and team is not None:
        return "team:" + team.id
    return "key:" + key.id


def salt_for(secret: bytes, tenant: str, client_salt: str | None) -> str | None:
    """The engine's ``cache_salt`` for ``tenant`` ('' = shared) and the client's own
    salt; None when the request shares everyone's cache (shared, no client salt)."""
    if not tenant and not client_salt:
        return None
    mac = hmac.new(secret, tenant.encode() + b"\x00" + (client_salt or "").encode("utf-8", "surrogatepass"), "sha256")
    return base64.urlsafe_b64encode(mac.digest()).decode()[:SALT_CHARS]


def client_salt_of(body: dict[str, Any]) -> str | None:
    """The client's ``cache_salt``, checked as vLLM checks it; a 400 naming it otherwise."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CLIENT_SALT_CHARS:
        raise OpenAIError(
            400,
            f"'cache_salt' must be a non-empty string of at most {MAX_CLIENT_SALT_CHARS} characters.",
            param="cache_salt",
        )
    return salt


def take_prompt_cache_key(body: dict[str, Any]) -> str | None:
    """OpenAI's ``prompt_cache_key`` (a routing hint; the engine never sees it); a 400 when not a string."""
    value = body.pop("prompt_cache_key", None)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_PROMPT_CACHE_KEY_CHARS:
        raise OpenAIError(
            400,
            f"'prompt_cache_key' must be a string of at most {MAX_PROMPT_CACHE_KEY_CHARS} characters.",
            param="prompt_cache_key",
        )
    return value or None


def put_salt(body: dict[str, Any], salt: str | None) -> None:
    """``body`` carrying ``salt`` as vLLM's ``cache_salt``, or none (the shared cache)."""
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt


class CacheSalts:
    """Sets each request's ``cache_salt`` (and its ``prompt_cache_key``'s routing
    session) from the server secret in Redis; ``redis`` is a ``redis.asyncio`` client."""

    def __init__(self, redis) -> None:
        self.redis = redis
        self._secret: bytes | None = None
        self._own_secret = secrets.token_bytes(32)  # while Redis' cannot be read

    async def secret(self) -> bytes:
        if self._secret is None:
            try:
                await self.redis.set(redis_names.CACHE_SALT_SECRET, secrets.token_hex(32), nx=True)
                stored = await self.redis.get(redis_names.CACHE_SALT_SECRET)
            except REDIS_FAILED as exc:
                logger.warning("the cache salt secret could not be read (%s): salting with this process' own", exc)
                return self._own_secret
            if stored is None:  # deleted between the two calls: next time
                return self._own_secret
            self._secret = as_text(stored).encode()
        return self._secret

    async def salt(
        self, key: KeyRecord, team: TeamRecord | None, config: ModelConfig, client_salt: str | None
    ) -> str | None:
        """The ``cache_salt`` of a request of ``key`` (of ``team``) to the model ``config``;
        None when it shares everyone's cache."""
        tenant = tenant_of(isolation_level(key, team, config), key, team)
        if not tenant and not client_salt:
            return None
        return salt_for(await self.secret(), tenant, client_salt)

    @staticmethod
    def session(salt: str, value: str, kind: str = PROMPT_CACHE_SESSION) -> str:
        """The routing session ``value`` (of ``kind``) names within the tenant ``salt`` names."""
        digest = hashlib.blake2b(salt.encode() + b"\x00" + value.encode("utf-8", "surrogatepass"), digest_size=16)
        return kind + digest.hexdigest()

    async def routing_session(
        self,
        key: KeyRecord,
        team: TeamRecord | None,
        config: ModelConfig,
        salt: str | None,
        header: str | None,
        cache_key: str | None,
    ) -> str | None:
        """The routing session of a request of ``key`` to ``config``: its session
        ``header``'s, else its ``prompt_cache_key``'s, within its tenant (its cache
        ``salt`` where it has one; else the salt of its tenant, its team's or key's where
        it shares everyone's cache); None when it names none."""
        if not (header or cache_key):
            return None
        if salt is None:  # unsalted (everyone's cache, or an operation without one): never anyone's session
            tenant = tenant_of(isolation_level(key, team, config), key, team) or tenant_of("team", key, team)
            salt = salt_for(await self.secret(), tenant, None) or ""
        return self.session(salt, header, HEADER_SESSION) if header else self.session(salt, cache_key or "")

    async def isolate(
        self,
        body: dict[str, Any],
        key: KeyRecord,
        team: TeamRecord | None,
        config: ModelConfig,
        header: str | None = None,
    ) -> str | None:
        """What the gateway does to a request's body, for a router that sees the client's
        body (the edge's): sets ``body["cache_salt"]`` (removes it where the request shares
        everyone's cache), takes ``prompt_cache_key`` out; returns the request's routing
        session (its session ``header``'s, else that key's), or None. Raises the client's
        400 for either field."""
        client_salt = client_salt_of(body)
        cache_key = take_prompt_cache_key(body)
        salt = await self.salt(key, team, config, client_salt)
        put_salt(body, salt)
        return await self.routing_session(key, team, config, salt, header, cache_key)
