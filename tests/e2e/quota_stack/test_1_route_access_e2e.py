"""Every route's declared access, as the stack enforces it, generated from the route table.

For each route the ingress serves (``ROUTE_ACCESS``, serve_app/http/route_access.py), one
request with each credential a caller may hold: none, an API key, a key of a disabled
team, an identity token of the stack's OIDC provider, and the admin token (on a
``console`` route, the admin's console session). What each access promises:

- ``probe``: answers anyone (never a 401 or a 5xx);
- ``key``: 401 without a credential and for the admin token (it is no key); a key and an
  identity token get past authentication (never a 401 or a 5xx); a disabled team's key
  is answered nothing (never a 2xx);
- ``admin``: 401 for every credential but the admin's, which gets past it;
- ``console``: without the admin's session, no console (the login form, or a redirect to
  it, and no session cookie); with it, the console.

A route added to the table is called here with no change to this module, so a route whose
check is missing fails it; a handler that skips its check is refused by its guard (a
500 here, never data). Path parameters name nothing that exists (and bodies are empty), so
no call changes a thing; each call's status is all that is asserted.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from stack import create_key, create_key_of_disabled_team, wait_until_ready

from quota_stack.stack_args import ADMIN, MODEL
from serve_app.http.ingress import ROUTE_ACCESS

pytestmark = pytest.mark.e2e

CREDENTIALS = ("none", "key", "disabled_team_key", "identity_token", "admin")
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


@pytest.mark.parametrize("credential", CREDENTIALS)
@pytest.mark.parametrize("method, path", sorted(ROUTE_ACCESS))
def test_each_route_answers_each_credential_as_its_access_declares(
    base_url, secrets, console_session, method, path, credential
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
    response = call(base_url, method, path, secrets[credential])
    status = response.status_code
    # A readiness probe says 503 "starting" while a model has no replica that answered
    # (a replica restarting under the suite's load, at the moment it asks): its answer, not a failure.
    not_ready = access == "probe" and status == 503 and response.json().get("status") == "starting"
    assert status < 500 or not_ready, f"{credential}: {response.text}"
    allowed = {"probe": set(CREDENTIALS), "key": {"key", "identity_token"}, "admin": {"admin"}}[access]
    if credential in allowed:
        assert status != 401, f"{credential} refused: {response.text}"
    elif access == "key" and credential == "disabled_team_key":
        assert status >= 400, f"a disabled team's key was answered {status}: {response.text}"
    else:
        assert status == 401, f"{credential} answered {status}: {response.text}"
