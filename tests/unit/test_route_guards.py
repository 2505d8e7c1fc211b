"""The route guards (serve_app/http/route_access.py) on their own: declaring a route's
access is what checks it. An ``admin`` route's handler runs only after its guard found the
admin; a ``key`` route whose handler answers without checking a key is refused; a
handler declared twice with two accesses is an error at import. (Every route of the
stack with every credential: tests/e2e/quota_stack/test_1_route_access_e2e.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from serve_app.errors import OpenAIError
from serve_app.http.route_access import Routes, admin_of
from serve_app.identity.authentication import Authenticator
from serve_app.identity.keys import KeyRecord
from serve_app.settings import AppSettings

KEY = KeyRecord(id="k1", name="k", created_at=0)


def request(token: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""})


class Keys:
    """A key store that knows one secret."""

    redis = None

    async def authenticate(self, secret: str):
        return KEY if secret == "sk-good" else None


def owner() -> SimpleNamespace:
    settings = AppSettings(admin_token="admin-secret-of-32-characters-long")
    telemetry = SimpleNamespace(redis_failed=lambda what: None, fell_back=lambda what: None)
    authenticator = Authenticator(Keys(), None, None, settings, telemetry)

    async def passes(headers):  # no Redis: the guard on failed admin credentials lets every one through
        return None

    authenticator.credential_guard = SimpleNamespace(check=passes, failed=passes)
    return SimpleNamespace(authenticator=authenticator)


def handlers():
    route = Routes(FastAPI())

    @route("GET", "/checked", "key")
    async def checked(self, request: Request):
        key = await self.authenticator.authenticate(request.headers)
        return JSONResponse({"key": key.id})

    @route("GET", "/unchecked", "key")
    async def unchecked(self, request: Request):  # a handler that forgot its key
        return JSONResponse({"data": "a tenant's"})

    @route("GET", "/admin", "admin")
    async def admin(self, request: Request):
        return JSONResponse({"actor": admin_of(request)})

    return route, checked, unchecked, admin


async def test_a_key_route_answers_only_once_its_handler_checked_a_key():
    _, checked, unchecked, _ = handlers()
    assert (await checked(self=owner(), request=request("sk-good"))).status_code == 200
    with pytest.raises(OpenAIError) as refused:
        await unchecked(self=owner(), request=request("sk-good"))
    assert refused.value.status == 500
    with pytest.raises(OpenAIError) as no_key:
        await checked(self=owner(), request=request())
    assert no_key.value.status == 401


async def test_an_admin_check_does_not_count_as_a_key_check():
    route = Routes(FastAPI())

    @route("GET", "/confused", "key")
    async def confused(self, request: Request):
        await self.authenticator.admin_actor(request.headers)
        return JSONResponse({})

    with pytest.raises(OpenAIError) as refused:
        await confused(self=owner(), request=request("admin-secret-of-32-characters-long"))
    assert refused.value.status == 500


async def test_an_admin_route_runs_its_handler_only_for_an_admin():
    _, _, _, admin = handlers()
    answered = await admin(self=owner(), request=request("admin-secret-of-32-characters-long"))
    assert answered.body == b'{"actor":"admin-token"}'
    for token in (None, "sk-good", "admin-secre"):
        with pytest.raises(OpenAIError) as refused:
            await admin(self=owner(), request=request(token))
        assert refused.value.status == 401


def test_the_table_is_what_was_declared_and_one_handler_has_one_access():
    route, *_ = handlers()
    assert route.access == {("GET", "/checked"): "key", ("GET", "/unchecked"): "key", ("GET", "/admin"): "admin"}
    with pytest.raises(ValueError, match="already a 'key' route"):

        @route("GET", "/also-admin", "admin")
        @route("GET", "/also-key", "key")
        async def both(self, request: Request):
            return JSONResponse({})

    with pytest.raises(ValueError, match="unknown access"):
        route("GET", "/x", "anyone")
