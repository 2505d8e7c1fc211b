"""A direct route's declared access, as its replicas enforce it, generated from its route
table (``DIRECT_ROUTES``, serve_app/http/direct.py) as the ingress' is in
tests/e2e/quota_stack/test_1_route_access_e2e.py: each route at the model's prefix
(``/direct/<model>``, through the edge) with no credential, an API key, a key of a
disabled team and a bearer token that is no key (this stack trusts no identity provider
and has no admin token). A ``key`` route answers a key and refuses the others; the
``probe`` route (the names the edge reads from a replica) is never answered through the
edge, and never a 401 or a 5xx."""

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
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    if path.endswith("/embeddings"):
        body = {"model": MODEL, "input": "hi"}  # the chat model serves none: a 4xx past authentication
    response = httpx.request(
        method,
        base_url + direct_route_prefix(MODEL) + path,
        headers=headers,
        timeout=120,
        json=body if method == "POST" else None,
    )
    status = response.status_code
    assert status < 500, f"{credential}: {response.text}"
    if DIRECT_ROUTES[(method, path)] == "probe":
        assert status == 404, response.text  # the edge stamps its requests: never answered through it
    elif credential == "key":
        assert status != 401, response.text
    elif credential == "disabled_team_key":
        assert status >= 400, f"a disabled team's key was answered {status}: {response.text}"
    else:
        assert status == 401, f"{credential} answered {status}: {response.text}"
