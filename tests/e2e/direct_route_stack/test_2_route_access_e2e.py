"""A direct route's declared access, as its replicas enforce it, generated from its route
table (``DIRECT_ROUTES``, serve_app/http/direct.py) as the ingress' is in
tests/e2e/quota_stack/test_1_route_access_e2e.py: each route at the model's prefix
(``/direct/<model>``, through the edge) with no credential, an API key, a key of a
disabled team and a bearer token that is no key (this stack trusts no identity provider
and has no admin token). A ``key`` route is sent a valid request: a key gets its answer
(200; the chat model's refusal of an embedding, naming it), the others their exact 401
(``team_disabled``, ``invalid_api_key``); the ``probe`` route (the names the edge reads
from a replica) is never answered through the edge."""

from __future__ import annotations

import time

import httpx
import pytest
from stack import create_key, create_key_of_disabled_team

from contract.model_config import direct_route_prefix
from direct_route_stack.stack_args import MODEL
from serve_app.http.direct import DIRECT_ROUTES

pytestmark = pytest.mark.e2e

CREDENTIALS = ("none", "key", "disabled_team_key", "not_a_key")
VALID_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "max_tokens": 1, "prompt": "hi"},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
}
# The stack's one model is a chat model: an embedding is refused past authentication.
KEY_ANSWERS = {"/v1/embeddings": 400}


@pytest.fixture(scope="module")
def secrets(base_url, redis_server) -> dict[str, str | None]:
    tag = time.monotonic_ns()
    return {
        "none": None,
        "key": create_key(redis_server.url, f"direct-access-{tag}")[1],
        "disabled_team_key": create_key_of_disabled_team(redis_server.url, f"direct-access-off-{tag}"),
        "not_a_key": "sk-" + "0" * 40,
    }


@pytest.mark.parametrize("credential", CREDENTIALS)
@pytest.mark.parametrize("method, path", sorted(DIRECT_ROUTES))
def test_each_direct_route_answers_each_credential_as_its_access_declares(base_url, secrets, method, path, credential):
    headers = {"authorization": f"Bearer {secrets[credential]}"} if secrets[credential] else {}
    body = VALID_BODIES.get(path)
    response = httpx.request(
        method,
        base_url + direct_route_prefix(MODEL) + path,
        headers=headers,
        timeout=120,
        json=body if method == "POST" else None,
    )
    status, where = response.status_code, f"{method} {path} with {credential}: {response.text[:300]}"
    if DIRECT_ROUTES[(method, path)] == "probe":
        assert status == 404, where  # the edge stamps its requests: never answered through it
    elif credential == "key":
        assert status == KEY_ANSWERS.get(path, 200), where
        if path in KEY_ANSWERS:
            assert "embedding" in response.json()["error"]["message"].lower(), where
    else:
        error = response.json()["error"]
        code, message = {
            "none": ("invalid_api_key", "You didn't provide an API key"),
            "disabled_team_key": ("team_disabled", "is disabled or does not exist"),
            "not_a_key": ("invalid_api_key", "Incorrect API key provided"),
        }[credential]
        assert status == 401 and error["code"] == code and message in error["message"], where
