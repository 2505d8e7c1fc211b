"""Identity from the company's OIDC provider: a request's ``Authorization: Bearer
<JWT>`` is verified against the provider's published keys (JWKS) and becomes a key
record for its user, admitted and charged exactly as an API key is (its own
requests/min, tokens/min, concurrency and budgets in Redis, under a key id derived
from the issuer and the user claim).

What is checked, each a 401 naming it: the signature (only the configured
asymmetric algorithms, the key chosen by the token's ``kid`` and of the type its
``alg`` needs: no ``none``, no HMAC with a public key), ``iss``, ``aud``, ``exp``
(required) and ``nbf``, with ``leeway_s``; the user claim present and a plain
string. Keys are cached ``jwks_cache_s`` and fetched again before then beside the
requests (no request waits for a renewal); a ``kid`` not among them fetches the JWKS
again at most every ``jwks_refresh_min_s`` (rotation is picked up, a flood of made-up
kids costs one fetch); while the JWKS cannot be fetched, tokens signed by a cached
key still verify, without waiting for the fetches tried meanwhile, and any other token
is refused: nothing unverified is admitted."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import urllib.request
from typing import Any

import jwt

from contract.model_config import PRIORITY_TIERS
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.settings import JwtConfig

logger = logging.getLogger("ray.serve")

MAX_TOKEN_CHARS = 16_384  # an IdP's tokens are a few KB; past this it is not one
MAX_JWKS_BYTES = 1 << 20
MAX_USER_CHARS = 256
# The share of ``jwks_cache_s`` after a fetch that the next is made beside the requests:
# early enough that it has answered before the copy is stale.
RENEW_AT = 0.8
MIN_RETRY_S = 1.0  # a failed fetch is tried again no sooner (jwks_refresh_min_s may be 0)


def is_jwt_identity(key_id: str) -> bool:
    """Whether a key id is a JWT user's (``_record``), not a stored API key's ("k…"):
    nothing in the key store to read again, and no revocation but the token's expiry."""
    return key_id.startswith("j")


def looks_like_jwt(secret: str) -> bool:
    """Three base64url parts: what a JWS compact token looks like (API keys never do)."""
    return secret.count(".") == 2 and not secret.startswith("sk-")


def _refused(reason: str) -> OpenAIError:
    return OpenAIError(401, f"Invalid identity token: {reason}.", code="invalid_api_key")


class JwtAuthenticator:
    def __init__(self, config: JwtConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at: float | None = None  # the last fetch that answered
        self._tried_at: float | None = None  # the last fetch, answered or not
        self._fetching: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next fetch beside the requests
        self._background: asyncio.Future | None = None  # a fetch beside the requests (kept: not collected)

    async def authenticate(self, token: str) -> KeyRecord:
        if len(token) > MAX_TOKEN_CHARS:
            raise _refused("too long")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise _refused("not a well-formed JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self.config.algorithms:
            raise _refused(f"algorithm {alg!r} is not accepted")
        if not isinstance(kid, str) or not kid:
            raise _refused("no key id (kid) in its header")
        key = await self._key(kid)
        if key is None:
            raise _refused(f"signed by an unknown key {kid[:64]!r}")
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise _refused("expired") from None
        except jwt.InvalidAudienceError:
            raise _refused("not for this audience") from None
        except jwt.InvalidIssuerError:
            raise _refused("not from the configured issuer") from None
        except jwt.ImmatureSignatureError:
            raise _refused("not valid yet") from None
        except jwt.exceptions.InvalidSubjectError:
            raise _refused("its 'sub' claim is not a string") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _refused(f"no '{exc.claim}' claim") from None
        except jwt.InvalidSignatureError:
            raise _refused("its signature does not verify") from None
        except (jwt.PyJWTError, ValueError, TypeError):
            raise _refused("it does not verify") from None
        return self._record(claims)

    def _record(self, claims: dict[str, Any]) -> KeyRecord:
        config = self.config
        user = claims.get(config.user_claim)
        if not isinstance(user, str) or not user or len(user) > MAX_USER_CHARS:
            raise _refused(f"no usable '{config.user_claim}' claim")
        limits = config.limits.model_dump()
        if config.tier_claim is not None and claims.get(config.tier_claim) in PRIORITY_TIERS:
            limits["priority"] = claims[config.tier_claim]
        if config.models_claim is not None:
            granted = claims.get(config.models_claim)
            granted = [m for m in granted if isinstance(m, str)] if isinstance(granted, list) else []
            allowed = limits["models"]
            limits["models"] = [m for m in granted if allowed is None or m in allowed]
        # One id per user of one issuer: its limits' state in Redis, its usage and records.
        key_id = "j" + hashlib.sha256(f"{config.issuer}\n{user}".encode()).hexdigest()[:16]
        return KeyRecord(id=key_id, name=f"jwt:{user}", created_at=0, team=self._team(claims), **limits)

    def _team(self, claims: dict[str, Any]) -> str | None:
        """The team's name the first of the claim's values that ``teams`` maps names
        (Authenticator.team_of finds the team by it); None (or a 401, ``unmapped_team``)
        when none is mapped. A value is never a team's name or id by itself: who may make
        a group in the provider would pick any team's budget and cache."""
        if self.config.team_claim is None:
            return None
        value = claims.get(self.config.team_claim)
        for candidate in value if isinstance(value, list) else [value]:
            if isinstance(candidate, str) and candidate in self.config.teams:
                return self.config.teams[candidate]
        if self.config.unmapped_team == "refuse":
            raise _refused(f"no '{self.config.team_claim}' value it carries is a team's group")
        return None

    async def _key(self, kid: str) -> jwt.PyJWK | None:
        """The signing key ``kid`` names. A cached one answers at once while its copy is
        younger than ``jwks_cache_s``; a timer fetches the JWKS again before then (at
        ``RENEW_AT`` of it, beside the requests), so a key the provider removed is refused
        within ``jwks_cache_s`` plus one fetch, by a process with no token to verify too.
        While the provider does not answer (the last fetch failed, or one is under way)
        the cached keys keep verifying and no request waits: one fetch at a time is tried
        beside them, at most every ``jwks_refresh_min_s``. A stale copy the timer did not
        renew (a loop stalled past it) is fetched on the request's path, as is an unknown
        kid (a rotation, or made up), at most once every ``jwks_refresh_min_s``."""
        now = self.clock()
        fresh = self._fetched_at is not None and now - self._fetched_at < self.config.jwks_cache_s
        waited = self._tried_at is None or now - self._tried_at >= self.config.jwks_refresh_min_s
        failing = self._fetching is not None or self._provider_failing()
        if kid in self._keys and (fresh or failing):
            if not fresh and waited:
                self._beside_requests()  # a fetch already under way is left to answer
            return self._keys[kid]
        if waited or not (fresh or self._provider_failing()):  # unknown kid, or a copy the timer missed
            await self._refresh()
        return self._keys.get(kid)

    def _provider_failing(self) -> bool:
        """Whether the last fetch tried failed (the keys are those of one before it)."""
        return self._tried_at is not None and (self._fetched_at is None or self._tried_at > self._fetched_at)

    def _beside_requests(self) -> None:
        """A fetch as a task of its own (kept referenced: the loop holds tasks weakly)."""
        if self._fetching is None:
            self._background = asyncio.ensure_future(self._refresh())

    def _renew_later(self, delay: float) -> None:
        """The next fetch beside the requests, ``delay`` seconds from now (the last
        timer replaced: one per authenticator, on the loop that verifies its tokens)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._beside_requests)

    async def _refresh(self) -> None:
        """One fetch at a time; requests arriving meanwhile wait for it. Each arms the
        timer for the next: ``RENEW_AT`` of ``jwks_cache_s`` after one that answered,
        ``jwks_refresh_min_s`` (a second at least) after one that failed."""
        if self._fetching is not None:
            await asyncio.shield(self._fetching)
            return
        self._fetching = asyncio.get_running_loop().create_future()
        self._tried_at = self.clock()
        renew_in = max(self.config.jwks_refresh_min_s, MIN_RETRY_S)
        try:
            keys = await asyncio.to_thread(self._fetch)
        except Exception as exc:  # unreachable, not JSON, no keys: the cached keys stay, nothing else verifies
            logger.warning("JWKS %s could not be fetched: %s", self.config.jwks_url, exc)
        else:
            self._keys, self._fetched_at = keys, self.clock()
            renew_in = self.config.jwks_cache_s * RENEW_AT
        finally:
            self._fetching.set_result(None)
            self._fetching = None
            self._renew_later(renew_in)

    def _fetch(self) -> dict[str, jwt.PyJWK]:
        with urllib.request.urlopen(self.config.jwks_url, timeout=self.config.jwks_timeout_s) as answer:
            document = json.loads(answer.read(MAX_JWKS_BYTES + 1)[:MAX_JWKS_BYTES])
        keys = {}
        for entry in document.get("keys", []):
            if not isinstance(entry, dict) or not isinstance(entry.get("kid"), str) or entry.get("use", "sig") != "sig":
                continue
            try:
                keys[entry["kid"]] = jwt.PyJWK(entry)
            except jwt.PyJWTError:
                continue  # a key type or curve this verifier does not know
        if not keys:
            raise ValueError("the JWKS holds no signing key")
        return keys
