"""Every route's declared access, as the stack enforces it, generated from the route table.

For each route the ingress serves (``ROUTE_ACCESS``, serve_app/http/route_access.py), one
request with each credential a caller may hold: none, an API key, a key of a disabled
team, an identity token of the stack's OIDC provider, and the admin token (on a
``console`` route, the admin's console session). What each access promises:

- ``probe``: answers anyone (never a 401 or a 5xx);
- ``key``: 401 without a credential and for the admin token (it is no key), 401
  ``team_disabled`` for a key of a disabled team; a key gets the route's answer to a
  valid request (tests/route_requests.py: valid bodies, ids the key owns), an identity
  token the same (another caller's ids: 404; a batch: 403, it needs an API key). Each
  is asserted exactly, status and error, so a route that skips one check fails;
- ``admin``: a valid request (tests/route_requests.py: a body it takes, ids that exist)
  is the route's answer for the admin's credential and an exact 401 for every other;
- ``console``: without the admin's session, no console (the login form, or a redirect to
  it, and no session cookie); with it, the console.

A route added to the table is called here with no change to this module, so a route whose
check is missing fails it (a ``key`` route needs its valid request in
tests/route_requests.py, an ``admin`` route its own there); a handler that skips its
check is refused by its guard (a 500 here, never data). The probes' and the console's
path parameters name nothing that exists and their bodies are empty.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from route_requests import AdminOwned, Owned, admin_route_requests, key_route_requests
from stack import create_key, create_key_of_disabled_team, wait_until_ready

from quota_stack.stack_args import ADMIN, MODEL
from serve_app.http.ingress import ROUTE_ACCESS

pytestmark = pytest.mark.e2e

CREDENTIALS = ("none", "key", "disabled_team_key", "identity_token", "admin")
# What a key's valid request is answered, where it is not 200: the stack's one model is a
# chat model, so a pooling route's request is refused past authentication, naming it.
# Azure AI model inference's routes answer 422 (its code for an unusable parameter).
KEY_ANSWERS: dict[tuple[str, str], int] = {
    ("POST", "/embeddings"): 422,
    ("POST", "/models/embeddings"): 422,
    ("POST", "/v1/embeddings"): 400,
    ("POST", "/v3/embeddings"): 400,
    ("POST", "/serving-endpoints/embeddings"): 400,
    ("POST", "/score"): 400,
    ("POST", "/v1/score"): 400,
    ("POST", "/rerank"): 400,
    ("POST", "/v1/rerank"): 400,
    ("POST", "/v2/rerank"): 400,
}
# Routes whose path names the caller's own file, batch or stored response.
OWNED = ("{file_id}", "{batch_id}", "{response_id}")
_PARAM = re.compile(r"\{(\w+)(?::path)?\}")


def filled(path: str) -> str:
    """``path`` with each parameter naming something that does not exist (a model: the served one)."""
    return _PARAM.sub(lambda match: MODEL if match.group(1) == "model_id" else f"absent-{match.group(1)}", path)


@pytest.fixture(scope="module")
def secrets(base_url, redis_server, jwks) -> dict[str, str | None]:
    wait_until_ready(base_url)  # the probes answer 200 once ready
    tag = time.monotonic_ns()
    disabled = create_key_of_disabled_team(redis_server.url, f"access-disabled-{tag}")
    return {
        "none": None,
        "key": create_key(redis_server.url, f"access-{tag}")[1],
        "disabled_team_key": disabled,
        "identity_token": jwks.token("k1", sub=f"access-{tag}@example.com"),
        "admin": ADMIN,
    }


@pytest.fixture(scope="module")
def console_session(base_url) -> str:
    login = httpx.post(
        base_url + "/console/login", data={"credential": ADMIN}, headers={"origin": base_url}, timeout=30
    )
    assert login.status_code == 303, login.text
    return login.cookies["llm_console"]


def call(base_url: str, method: str, path: str, secret: str | None, cookies: dict | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    if method in ("POST", "PATCH", "PUT"):
        headers["content-type"] = "application/json"
    return httpx.request(
        method,
        base_url + filled(path),
        headers=headers,
        cookies=cookies,
        timeout=60,
        content=b"{}" if method in ("POST", "PATCH", "PUT") else None,
    )


def test_every_route_declares_an_access_this_module_knows():
    assert set(ROUTE_ACCESS.values()) <= {"probe", "key", "admin", "console"}
    key_routes = {route for route, access in ROUTE_ACCESS.items() if access == "key"}
    assert set(key_route_requests(MODEL, Owned("", "", MODEL))) == key_routes  # each has its valid request
    admin_routes = {route for route, access in ROUTE_ACCESS.items() if access == "admin"}
    assert set(admin_route_requests(AdminOwned("", "", MODEL, ""))) == admin_routes


@pytest.mark.parametrize("credential", CREDENTIALS)
@pytest.mark.parametrize("method, path", sorted(ROUTE_ACCESS))
def test_each_route_answers_each_credential_as_its_access_declares(
    base_url, redis_server, jwks, secrets, console_session, method, path, credential
):
    access = ROUTE_ACCESS[(method, path)]
    if access == "console":
        cookies = {"llm_console": console_session} if credential == "admin" else None
        response = call(base_url, method, path, secrets[credential], cookies)
        assert response.status_code < 500, response.text
        page = response.text if response.status_code < 300 else ""
        signed_in = "action='/console/logout'" in page  # the console itself, not its login form
        if credential == "admin":
            if method == "GET":
                assert signed_in, page
        else:
            assert not signed_in and "llm_console" not in response.cookies, page
            if method == "POST" and path != "/console/login":  # a form acts on nothing: back to the login form
                assert response.status_code == 303 and response.headers["location"] == "/console"
        return
    if access == "key":
        return answers_as_a_key_route(base_url, redis_server, jwks, secrets, method, path, credential)
    if access == "admin":
        return answers_as_an_admin_route(base_url, secrets, method, path, credential)
    response = call(base_url, method, path, secrets[credential])
    status = response.status_code
    # A readiness probe says 503 "starting" while a model has no replica that answered
    # (a replica restarting under the suite's load, at the moment it asks): its answer, not a failure.
    not_ready = access == "probe" and status == 503 and response.json().get("status") == "starting"
    assert status < 500 or not_ready, f"{credential}: {response.text}"
    assert status != 401, f"{credential} refused: {response.text}"  # a probe answers anyone


def answers_as_an_admin_route(base_url, secrets, method, path, credential) -> None:
    """One ``admin`` route's valid request, its ids made by the admin: the route's answer
    for the admin's credential, an exact 401 for any other (the ids exist: a route whose
    check is missing answers them)."""
    owned = AdminOwned(base_url, ADMIN, MODEL, f"{time.monotonic_ns()}")
    request, expected = admin_route_requests(owned)[(method, path)]()
    secret = secrets[credential]
    response = request.send(base_url, {"authorization": f"Bearer {secret}"} if secret else {})
    status, where = response.status_code, f"{method} {path} with {credential}: {response.text[:300]}"
    if credential != "admin":
        assert status == 401, where
        assert_refused_as(response, ADMIN_REFUSALS[credential], where)
    elif (method, path) == ("POST", "/admin/batches/{batch_id}/cancel") and status != expected:
        # Its batch of one short line can finish before the cancel comes: refused as ended.
        ended = ("batch_not_found", "batch_not_cancellable")
        assert status in (404, 409) and error_of(response)["code"] in ended, where
    else:
        assert status == expected, where


# What each credential that may not use a route is answered: the error's code (where the
# route's envelope has codes) and its message, which every envelope carries.
KEY_REFUSALS = {
    "none": ("invalid_api_key", "You didn't provide an API key"),
    "admin": ("invalid_api_key", "Incorrect API key provided"),  # the admin token is no key
    "disabled_team_key": ("team_disabled", "is disabled or does not exist"),
}
ADMIN_REFUSALS = {
    "none": ("invalid_api_key", "invalid or missing admin credential"),
    "key": ("invalid_api_key", "not an admin credential"),
    "disabled_team_key": ("invalid_api_key", "not an admin credential"),
    "identity_token": ("invalid_api_key", "not an admin credential"),
}


def assert_refused_as(response: httpx.Response, refusal: tuple[str, str], where: str) -> None:
    code, message = refusal
    error = error_of(response)
    assert message in error.get("message", ""), f"{where}: {response.text[:300]}"
    assert error.get("code", code) == code, f"{where}: {response.text[:300]}"


def error_of(response: httpx.Response) -> dict:
    """The error of an answer in any route's envelope (OpenAI's, Anthropic's, a dialect's)."""
    body = response.json()
    error = body.get("error", body)
    return error if isinstance(error, dict) else {"message": str(error)}


def answers_as_a_key_route(base_url, redis_server, jwks, secrets, method, path, credential) -> None:
    """One ``key`` route's valid request with ``credential``, asserted exactly. A key and an
    identity token are new for the call (each has room under its limits; the key owns the
    ids its path names); the identity token is sent the key's ids."""
    tag = f"{time.monotonic_ns()}"
    owner = create_key(redis_server.url, f"access-owner-{tag}")[1]
    request = key_route_requests(MODEL, Owned(base_url, owner, MODEL))[(method, path)]()
    secret = {"key": owner, "identity_token": jwks.token("k1", sub=f"access-{tag}@example.com")}.get(
        credential, secrets[credential]
    )
    response = request.send(base_url, {"authorization": f"Bearer {secret}"} if secret else {})
    status, where = response.status_code, f"{method} {path} with {credential}: {response.text[:300]}"
    if credential in KEY_REFUSALS:
        assert status == 401, where
        assert_refused_as(response, KEY_REFUSALS[credential], where)
    elif credential == "identity_token" and any(part in path for part in OWNED):
        assert status == 404, where  # the key's, not the token's user's
    elif credential == "identity_token" and (method, path) == ("POST", "/v1/batches"):
        assert status == 403 and error_of(response)["code"] == "batch_needs_api_key", where
    elif (method, path) == ("POST", "/v1/batches/{batch_id}/cancel") and status == 409:
        # Its batch of one short line can finish before the cancel comes (a CI run):
        # refused as finished, after the key passed authentication and ownership.
        assert credential == "key" and error_of(response)["code"] == "batch_not_cancellable", where
    else:
        assert status == KEY_ANSWERS.get((method, path), 200), where
