"""Identity tokens from an OIDC provider (serve_app/identity/jwt_auth.py) against a JWKS
server this test runs: real RS256 and ES256 signatures, key rotation by ``kid``, the
refetch bound on unknown kids, an unreachable JWKS, and the tokens an attacker
would forge. Then a token's user admitted exactly as a key (its own limit in Redis)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwks_server import AUDIENCE, ISSUER, Jwks

from serve_app.admission.seam import Refusal
from serve_app.errors import OpenAIError
from serve_app.http.services import build_quota_services
from serve_app.identity.jwt_auth import JwtAuthenticator
from serve_app.settings import AppSettings, JwtConfig
from serve_app.telemetry import Telemetry


def hs256(secret: bytes, header: dict, claims: dict) -> str:
    """A token signed by hand (PyJWT refuses to key HMAC with a public key, as an attacker would not)."""

    def part(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = part(json.dumps(header).encode()) + "." + part(json.dumps(claims).encode())
    return signing_input + "." + part(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())


@pytest.fixture
def jwks():
    server = Jwks()
    yield server
    server.stop()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def config(jwks: Jwks, **changes) -> JwtConfig:
    return JwtConfig(
        **{
            "issuer": ISSUER,
            "audience": AUDIENCE,
            "jwks_url": jwks.url,
            "tier_claim": "tier",
            "models_claim": "models",
            "limits": {"requests_per_minute": 2, "models": ["tiny-llama", "minilm"]},
            **changes,
        }
    )


async def refused(auth: JwtAuthenticator, token: str) -> str:
    with pytest.raises(OpenAIError) as caught:
        await auth.authenticate(token)
    assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
    return caught.value.message


async def test_rs256_and_es256_tokens_become_their_users_records_with_the_claims_mapped(jwks):
    jwks.add("r1", "rsa")
    jwks.add("e1", "ec")
    auth = JwtAuthenticator(config(jwks))
    alice = await auth.authenticate(jwks.token("r1", tier="high", models=["tiny-llama", "gpt-9", 7]))
    assert alice.name == "jwt:alice" and alice.requests_per_minute == 2 and alice.priority == "high"
    assert alice.models == ["tiny-llama"]  # granted by the claim and allowed by the config
    again = await auth.authenticate(jwks.token("e1", tier="root"))  # ES256; an unknown tier keeps the default
    assert again.id == alice.id and again.priority == "normal" and again.models == []
    bob = await auth.authenticate(jwks.token("e1", sub="bob"))
    assert bob.id != alice.id and bob.id.startswith("j")
    assert jwks.fetches == 1  # one fetch, both keys cached


async def test_forged_expired_and_misdirected_tokens_are_401s_naming_why(jwks):
    jwks.add("r1")
    auth = JwtAuthenticator(config(jwks))
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert "signature" in await refused(auth, jwks.token("r1", key=stranger))
    assert "expired" in await refused(auth, jwks.token("r1", exp=int(time.time()) - 3600))
    assert "audience" in await refused(auth, jwks.token("r1", aud="another-app"))
    assert "issuer" in await refused(auth, jwks.token("r1", iss="https://evil.example.com/"))
    assert "'exp'" in await refused(auth, jwks.token("r1", exp=None))
    assert "not valid yet" in await refused(auth, jwks.token("r1", nbf=int(time.time()) + 3600))
    assert "sub" in await refused(auth, jwks.token("r1", sub=None))
    assert "sub" in await refused(auth, jwks.token("r1", sub={"id": 1}))
    assert "kid" in await refused(auth, jwks.token("", key=jwks.keys["r1"]))
    # alg none, and HMAC keyed with the provider's public key (the classic confusion).
    unsigned = jwt.encode(
        {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": int(time.time()) + 60},
        None,
        algorithm="none",
        headers={"kid": "r1"},
    )
    assert "algorithm" in await refused(auth, unsigned)
    public_pem = jwks.keys["r1"].public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    forged = hs256(
        public_pem,
        {"alg": "HS256", "kid": "r1", "typ": "JWT"},
        {"sub": "x", "iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 60},
    )
    assert "algorithm" in await refused(auth, forged)
    # An ES256 header over the RSA key's kid: the key type does not fit.
    ec_key = ec.generate_private_key(ec.SECP256R1())
    await refused(auth, jwks.token("r1", key=ec_key, alg="ES256"))
    for garbage in ("a.b.c", "x" * 20_000 + ".a.b", "eyJhbGciOiJSUzI1NiJ9..", "...", "\u00e9.\u00e9.\u00e9"):
        await refused(auth, garbage)


async def test_rotation_is_picked_up_and_made_up_kids_cost_one_fetch_per_interval(jwks):
    jwks.add("old")
    clock = Clock()
    auth = JwtAuthenticator(config(jwks, jwks_refresh_min_s=30), clock=clock)
    await auth.authenticate(jwks.token("old"))
    for n in range(50):  # a flood of made-up kids
        await refused(auth, jwks.token(f"made-up-{n}", key=jwks.keys["old"]))
    assert jwks.fetches == 1  # within jwks_refresh_min_s of the last fetch: none again
    jwks.add("new")  # the provider rotates
    clock.now += 31
    await auth.authenticate(jwks.token("new"))  # an unknown kid past the interval: fetched, accepted
    assert jwks.fetches == 2
    retired = jwks.keys.pop("old")
    clock.now += 301  # past jwks_cache_s (5 min by default): the keys are fetched again, beside the request
    assert "unknown key" in await refused(auth, jwks.token("old", key=retired))
    await auth.authenticate(jwks.token("new", sub="carol"))


async def test_an_unreachable_jwks_keeps_cached_keys_and_admits_nothing_else(jwks):
    jwks.add("k1")
    clock = Clock()
    auth = JwtAuthenticator(config(jwks, jwks_refresh_min_s=0), clock=clock)
    await auth.authenticate(jwks.token("k1"))
    jwks.down = True
    await auth.authenticate(jwks.token("k1", sub="dave"))  # a cached key still verifies
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    await refused(auth, jwks.token("k2", key=stranger))  # unknown kid, JWKS down: never admitted
    clock.now += 3601  # the cache is stale and the JWKS still down: the cached keys still verify their tokens
    await auth.authenticate(jwks.token("k1", sub="erin"))
    jwks.down = False


async def test_while_the_provider_does_not_answer_the_cached_keys_verify_and_no_request_waits(jwks):
    """Past ``jwks_cache_s`` with the provider not answering, every wave of token requests
    waited ``jwks_timeout_s`` for a fetch that failed, although the cached keys still
    verified: now the fetch is made beside them (the timer's, before the copy is stale),
    and while it hangs or fails the cache answers at once; a failed fetch is tried again
    at most every ``jwks_refresh_min_s``."""
    jwks.add("k1")
    auth = JwtAuthenticator(config(jwks, jwks_cache_s=1.0, jwks_timeout_s=2, jwks_refresh_min_s=30))
    await auth.authenticate(jwks.token("k1"))
    jwks.hang_s, jwks.down = 3.0, True  # past the fetch's timeout, then an error
    await asyncio.sleep(1.2)  # the copy is stale; the timer's fetch (at 0.8 s) hangs
    assert jwks.fetches == 2 and auth._background is not None and not auth._background.done()
    for n in range(20):
        await asyncio.wait_for(auth.authenticate(jwks.token("k1", sub=f"u{n}")), timeout=0.5)  # never waits for it
    await auth._background  # it failed: the cached keys stay
    assert jwks.fetches == 2  # one fetch for the twenty
    await asyncio.wait_for(auth.authenticate(jwks.token("k1", sub="after")), timeout=0.5)
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert "unknown key" in await refused(auth, jwks.token("k2", key=stranger))  # nothing else verifies
    assert jwks.fetches == 2  # within jwks_refresh_min_s of the failed fetch: none again
    auth._timer.cancel()


async def test_a_key_the_provider_removes_is_refused_within_the_cache_bound_with_no_token_meanwhile(jwks):
    """A process with no token to verify renews its copy all the same (its timer), so
    the first token signed by a removed key after ``jwks_cache_s`` is refused, without
    a fetch on its path; a key the provider adds meanwhile verifies."""
    jwks.add("staying")
    jwks.add("leaving")
    auth = JwtAuthenticator(config(jwks, jwks_cache_s=1.0, jwks_refresh_min_s=30))
    await auth.authenticate(jwks.token("leaving"))
    retired = jwks.keys.pop("leaving")
    jwks.add("new")
    await asyncio.sleep(1.1)  # nothing asked meanwhile
    assert jwks.fetches == 2  # the timer's
    assert "unknown key" in await refused(auth, jwks.token("leaving", key=retired))
    await auth.authenticate(jwks.token("new", sub="bob"))
    await auth.authenticate(jwks.token("staying", sub="carol"))
    assert jwks.fetches == 2  # none on a request's path
    auth._timer.cancel()


async def test_a_token_user_is_admitted_exactly_as_a_key_of_its_limits(jwks, redis_url):
    jwks.add("k1")
    settings = AppSettings(redis_url=redis_url, auth={"jwt": config(jwks).model_dump()})
    access = build_quota_services(settings, Telemetry(False, False))
    try:
        headers = {"authorization": f"Bearer {jwks.token('k1', sub=f'frank-{time.monotonic_ns()}')}"}
        user = await access.authenticator.authenticate(headers)
        outcomes = [await access.gate.admit(user, "tiny-llama", 10) for _ in range(3)]  # requests_per_minute 2
        assert [isinstance(o, Refusal) for o in outcomes] == [False, False, True]
        # Another user of the same provider has limits of its own.
        other = await access.authenticator.authenticate(
            {"authorization": f"Bearer {jwks.token('k1', sub='grace-' + user.id)}"}
        )
        assert not isinstance(await access.gate.admit(other, "tiny-llama", 10), Refusal)
        # Its running requests are not "revoked" for want of a stored key.
        assert await access.maintenance.stop_revoked() == 0
    finally:
        await access.redis.aclose()


async def test_a_token_of_a_team_admits_as_a_key_of_that_team_and_is_charged_to_it(jwks, redis_url):
    from serve_app.admin import operations as admin
    from serve_app.admission.seam import Ticket
    from serve_app.redis_store import redis_names

    jwks.add("k1")
    team_name = f"ml-{time.monotonic_ns()}"
    settings = AppSettings(
        redis_url=redis_url,
        auth={
            "jwt": config(
                jwks, team_claim="groups", teams={"grp-ml": team_name}, limits={"requests_per_minute": 10}
            ).model_dump()
        },
    )
    access = build_quota_services(settings, Telemetry(False, False))
    try:
        team = await admin.create_team(access.stores, {"name": team_name, "requests_per_minute": 2}, "admin:test")
        token = jwks.token("k1", sub=f"hana-{time.monotonic_ns()}", groups=["grp-other", "grp-ml"])
        user = await access.authenticator.authenticate({"authorization": f"Bearer {token}"})
        assert user.team == team_name
        outcomes = [await access.gate.admit(user, "tiny-llama", 10) for _ in range(3)]  # the team's 2/min
        assert [type(o) for o in outcomes] == [Ticket, Ticket, Refusal] and outcomes[2].level == "team"
        assert outcomes[0].team.id == team["id"]
        day = time.strftime("d:%Y%m%d", time.gmtime())
        assert int(await access.redis.hget(redis_names.usage(team["id"]), f"{day}:requests")) == 2
        # Its team disabled: the user's running requests stop and new ones are refused.
        await admin.revoke_team(access.stores, team["id"], "admin:test")
        assert await access.maintenance.stop_revoked() == 2
        # A group no team is mapped to: the user's own limits only.
        loner = await access.authenticator.authenticate(
            {"authorization": f"Bearer {jwks.token('k1', groups=['grp-other'])}"}
        )
        assert loner.team is None and isinstance(await access.gate.admit(loner, "tiny-llama", 10), Ticket)
    finally:
        await access.redis.aclose()


async def test_a_group_naming_another_teams_name_or_id_is_no_team_unless_mapped(jwks, redis_url):
    """Groups map to teams only through ``teams``: a user who may create a group in the
    identity provider, named as another team's name or id, is not of that team (before:
    it was, and spent that team's budget and shared its cache); with ``unmapped_team:
    refuse`` such a token is a 401. And ``team_claim`` without ``teams`` does not start."""
    from pydantic import ValidationError

    from serve_app.admin import operations as admin

    jwks.add("k1")
    victim_name = f"victim-{time.monotonic_ns()}"
    for unmapped in ("none", "refuse"):
        settings = AppSettings(
            redis_url=redis_url,
            auth={
                "jwt": config(jwks, team_claim="groups", teams={"grp-ml": "ml"}, unmapped_team=unmapped).model_dump()
            },
        )
        access = build_quota_services(settings, Telemetry(False, False))
        try:
            if unmapped == "none":
                victim = await admin.create_team(access.stores, {"name": victim_name}, "admin:test")
            for group in (victim_name, victim["id"], ["grp-x", victim_name]):
                token = jwks.token("k1", sub=f"mallory-{time.monotonic_ns()}", groups=group)
                if unmapped == "none":
                    user = await access.authenticator.authenticate({"authorization": f"Bearer {token}"})
                    assert user.team is None, group
                else:
                    with pytest.raises(OpenAIError) as refused:
                        await access.authenticator.authenticate({"authorization": f"Bearer {token}"})
                    assert refused.value.status == 401 and "team's group" in refused.value.message
        finally:
            await access.redis.aclose()
    with pytest.raises(ValidationError, match="team_claim needs `teams`"):
        config(jwks, team_claim="groups")
