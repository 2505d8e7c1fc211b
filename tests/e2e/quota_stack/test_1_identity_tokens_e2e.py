"""Identity tokens of the company's OIDC provider on the real stack (the package's
stack accepts the tokens of a provider this test runs, tests/jwks_server.py): a
user's token works with the openai SDK as a key would, is admitted against the
user's own limits and charged to the user (its records in Redis), a bad token is a
401 in the route's envelope, a batch needs an API key, and a signing key the provider
removes is refused on every route within ``jwks_cache_s``."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from http_checks import assert_error_envelope
from settled import inference, wait_until_settled

from quota_stack.stack_args import JWKS_CACHE_S, JWT_REQUESTS_PER_MINUTE, MODEL
from serve_app.identity.jwt_auth import JwtAuthenticator
from serve_app.settings import JwtConfig

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "hi"}]


def user_id(jwks, sub: str) -> str:
    """The key id the gateway gives a token's user (jwt_auth.py)."""
    config = JwtConfig(issuer="https://idp.example.com/", audience="llm-gateway", jwks_url=jwks.url)
    return JwtAuthenticator(config)._record({"sub": sub}).id


def test_a_users_token_is_admitted_against_its_own_limits_and_charged_to_it(base_url, jwks, redis):
    sub = f"ana-{time.monotonic_ns()}@example.com"
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=jwks.token("k1", sub=sub), max_retries=0, timeout=120)
    answers = [
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        for _ in range(JWT_REQUESTS_PER_MINUTE)
    ]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert refused.value.response.json()["error"]["type"] == "requests"
    records = inference(wait_until_settled(redis, user_id(jwks, sub)))
    assert len(records) == JWT_REQUESTS_PER_MINUTE and {r["status"] for r in records} == {"completed"}
    assert sum(int(r["completion_tokens"]) for r in records) == sum(a.usage.completion_tokens for a in answers)
    # Another user of the provider has a limit of its own.
    other = openai.OpenAI(
        base_url=base_url + "/v1", api_key=jwks.token("k1", sub="bo-" + sub), max_retries=0, timeout=120
    )
    assert other.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).choices


def test_a_bad_token_is_a_401_naming_why_and_a_batch_needs_an_api_key(base_url, jwks):
    expired = jwks.token("k1", exp=int(time.time()) - 600)
    for token, reason in (
        (expired, "expired"),
        (jwks.token("k1", aud="someone-else"), "audience"),
        (jwks.token("k9", key=jwks.keys["k1"]), "unknown key"),
    ):
        response = httpx.post(
            base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO},
            headers={"authorization": f"Bearer {token}"},
            timeout=60,
        )
        assert_error_envelope(response, 401)
        assert reason in response.json()["error"]["message"]
    anthropic_style = httpx.post(
        base_url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 1, "messages": HELLO},
        headers={"x-api-key": expired},
        timeout=60,
    )
    assert anthropic_style.status_code == 401 and anthropic_style.json()["type"] == "error"
    batch = httpx.post(
        base_url + "/v1/batches",
        headers={"authorization": f"Bearer {jwks.token('k1')}"},
        timeout=60,
        json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert_error_envelope(batch, 403)
    assert batch.json()["error"]["code"] == "batch_needs_api_key"


# Every way in a token takes, by the process that serves it: the direct route's server
# (chat, completions), the ingress replicas (the rest), each keeping its own JWKS copy.
ROUTES = (
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1}),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
    ("GET", "/v1/models", None),
)


def test_a_signing_key_the_provider_removes_is_refused_on_every_route_within_the_cache_bound(base_url, jwks):
    jwks.add("leaving")
    # A process that fetched within jwks_refresh_min_s refuses a new kid until its copy
    # is past jwks_cache_s: then its next token fetches the JWKS again.
    time.sleep(JWKS_CACHE_S + 1)
    token = jwks.token("leaving", sub=f"dee-{time.monotonic_ns()}@example.com")

    def ask(method: str, path: str, body: dict | None) -> httpx.Response:
        return httpx.request(
            method, base_url + path, json=body, headers={"authorization": f"Bearer {token}"}, timeout=120
        )

    # Every process learns the key: each route asked often enough to reach both ingress
    # replicas (a 429 past the user's 3 requests/min is a token that verified, too).
    for method, path, body in ROUTES:
        for _ in range(4):
            response = ask(method, path, body)
            assert response.status_code != 401 and response.status_code < 500, (path, response.text)
    del jwks.keys["leaving"]  # the provider removes it
    removed = time.monotonic()
    time.sleep(JWKS_CACHE_S + 2)  # the bound: jwks_cache_s plus one fetch (a local one here)
    for method, path, body in ROUTES:
        for _ in range(6):
            response = ask(method, path, body)
            assert_error_envelope(response, 401)
            assert "unknown key" in response.json()["error"]["message"], (path, response.text)
    assert time.monotonic() - removed < JWKS_CACHE_S + 60  # the checks themselves took no minute


def test_while_the_provider_is_down_the_keys_it_served_verify_on_every_route(base_url, jwks):
    """The provider failing (503, each answer 2.5 s late) past every copy's jwks_cache_s:
    the keys it served keep verifying on every route (its outage is no tenant's 401 nor
    a 5xx), a kid it never served is a 401 naming it, and once it answers again a new
    kid verifies everywhere within jwks_refresh_min_s (30 s: the next fetch each process
    tries after a failed one)."""

    def ask(method: str, path: str, body: dict | None, kid: str) -> httpx.Response:
        token = jwks.token(kid, sub=f"outage-{time.monotonic_ns()}@example.com")
        return httpx.request(
            method, base_url + path, json=body, headers={"authorization": f"Bearer {token}"}, timeout=120
        )

    for method, path, body in ROUTES:  # every process holds a copy with k1 before the outage
        for _ in range(4):
            response = ask(method, path, body, "k1")
            assert response.status_code != 401 and response.status_code < 500, (path, response.text)
    jwks.down, jwks.hang_s = True, 2.5
    before = jwks.fetches
    try:
        time.sleep(JWKS_CACHE_S + 1)  # every copy past its cache: its renewals fail
        jwks.add("born-in-the-outage")
        for method, path, body in ROUTES:
            for _ in range(4):
                response = ask(method, path, body, "k1")
                # A 429 past the user's requests/min is a token that verified too.
                assert response.status_code != 401 and response.status_code < 500, (path, response.text)
            response = ask(method, path, body, "born-in-the-outage")
            assert_error_envelope(response, 401)
            assert "unknown key" in response.json()["error"]["message"], (path, response.text)
        assert jwks.fetches > before  # the gateway asked the failing provider, and went on without it
    finally:
        jwks.down, jwks.hang_s = False, 0.0
    deadline = time.monotonic() + 90
    for method, path, body in ROUTES:  # each process fetches again by itself: a new kid verifies
        for _ in range(4):
            while (response := ask(method, path, body, "born-in-the-outage")).status_code == 401:
                assert time.monotonic() < deadline, (path, response.text)
                time.sleep(1)
            assert response.status_code < 500, (path, response.text)
