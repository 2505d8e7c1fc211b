"""Every body any route reads is bounded in size and time by its route's declaration
(serve_app/http/body_bounds.py): every route of every app is a ``BoundedRoute``, and a
route's read of a body past its kind's limit is a 413, of one that has not arrived by
its deadline a 408, whatever the handler reads it with."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import Request
from starlette.responses import JSONResponse

from serve_app.http.body_bounds import MAX_FORM_BYTES, BodyBounds, BoundedRoute
from serve_app.http.request_handling import openai_app
from serve_app.http.route_access import Routes


def test_every_route_of_every_app_reads_its_body_through_its_bounds():
    from serve_app.http.direct import direct_app
    from serve_app.http.edge_router import router_app
    from serve_app.http.ingress import app

    for served in (app, direct_app, router_app):
        unbounded = [route.path for route in served.routes if not isinstance(route, BoundedRoute)]
        assert not unbounded, unbounded
    kinds = {(route.path, tuple(route.methods)): route.body_kind for route in app.routes}
    assert kinds[("/console/login", ("POST",))] == "form"
    assert kinds[("/v1/files", ("POST",))] == "upload"


def an_app(bounds: BodyBounds):
    served = openai_app("test")
    served.state.body_bounds = bounds
    routes = Routes(served)

    async def read(request: Request, how: str):
        if how == "form":
            return JSONResponse({"fields": len(await request.form())})
        if how == "stream":
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
            return JSONResponse({"size": size})
        return JSONResponse({"size": len(await request.body())})

    @routes("POST", "/form", "probe", body="form")
    async def form(request: Request):
        return await read(request, "form")

    @routes("POST", "/json", "probe")
    async def as_json(request: Request):
        return await read(request, "body")

    @routes("POST", "/stream", "probe")
    async def streamed(request: Request):
        return await read(request, "stream")

    @routes("GET", "/get", "probe")
    async def get(request: Request):
        return await read(request, "body")

    return served


def call(served, path: str, chunks: list[bytes], gap_s: float = 0.0, declare: bool = True, method: str = "POST"):
    """(status, chunks the app asked for) of a request whose body arrives as ``chunks``."""
    asked = []
    answer = {}

    async def receive():
        if asked and gap_s:
            await asyncio.sleep(gap_s)
        index = len(asked)
        asked.append(index)
        if index >= len(chunks):
            await asyncio.sleep(3600)  # the client sends nothing more
        return {"type": "http.request", "body": chunks[index], "more_body": index < len(chunks) - 1}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]

    headers = [(b"content-type", b"application/x-www-form-urlencoded")]
    if declare:
        headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"", "app": served}
    asyncio.run(served(scope, receive, send))
    return answer["status"], len(asked)


BOUNDS = BodyBounds(max_body_bytes=64 * 1024, body_timeout_s=0.5, max_file_bytes=1 << 20)


@pytest.mark.parametrize("path", ["/form", "/json", "/stream"])
def test_a_body_within_its_kind_is_read(path):
    assert call(an_app(BOUNDS), path, [b"a=1&b=2"] * 3)[0] == 200


@pytest.mark.parametrize(
    "path, limit", [("/form", MAX_FORM_BYTES), ("/json", BOUNDS.max_body_bytes), ("/stream", BOUNDS.max_body_bytes)]
)
def test_a_body_past_its_kind_is_a_413_read_no_further(path, limit):
    chunk = b"a" * 4096
    many = [chunk] * (limit // len(chunk) + 50)
    assert call(an_app(BOUNDS), path, many) == (413, 0)  # declared past it: not a byte read
    status, asked = call(an_app(BOUNDS), path, many, declare=False)  # chunked: counted as it arrives
    assert status == 413 and asked == limit // len(chunk) + 1


def test_a_route_that_takes_no_body_reads_at_most_a_stray_one():
    assert call(an_app(BOUNDS), "/get", [b"{}"], method="GET")[0] == 200
    assert call(an_app(BOUNDS), "/get", [b"a" * 8192], method="GET")[0] == 413


@pytest.mark.parametrize("path", ["/form", "/json", "/stream"])
def test_a_body_that_does_not_arrive_by_its_deadline_is_a_408(path):
    status, asked = call(an_app(BOUNDS), path, [b"a"] * 100, gap_s=0.05)  # a byte every 50 ms: 5 s in all
    assert status == 408 and asked < 15
    assert call(an_app(BOUNDS), path, [b"a=1"], declare=True)[0] == 200
