"""What an inference request costs before its admission (serve_app/http/request_handling.py):
the key is authenticated from the headers first; a body declared past
``room_check_bytes``, or declaring no length, is read only once the key has room
(``Gateway.refuse_before_body``); a smaller one is read with no extra round trip. The
authenticator and gateway faked; Redis' side is room.lua (tests/integration/test_admission.py)
and the real stack's is tests/e2e/quota_stack/test_1_hostile_tenant_e2e.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from serve_app.errors import OpenAIError
from serve_app.http.body_bounds import bounded_receive
from serve_app.http.request_handling import HandlesRequests
from serve_app.identity.keys import KeyRecord
from serve_app.telemetry import RequestRecord

KEY = KeyRecord(id="k1", name="n", created_at=0)
MAX_BODY_BYTES = 1 << 20  # the route's bound


class Authenticator:
    async def authenticate(self, headers, seen=None):
        if headers.get("authorization") != "Bearer sk":
            raise OpenAIError(401, "no key")
        return KEY


class Gateway:
    def __init__(self, full: bool):
        self.full, self.asked = full, 0

    async def refuse_before_body(self, key):
        self.asked += 1
        if self.full:
            raise OpenAIError(429, "at its limit", code="rate_limit_exceeded")


class Front(HandlesRequests):
    def __init__(self, gateway: Gateway):
        self.authenticator, self.gateway = Authenticator(), gateway  # type: ignore[assignment]
        self.room_check_bytes = 1024


def request(body: bytes, declared: bool = True, credential: str = "Bearer sk") -> tuple[Request, list[int]]:
    """A POST whose body the test can see being read: ``read`` holds the bytes handed out."""
    read: list[int] = []
    chunks = [body[i : i + 256] for i in range(0, len(body), 256)] or [b""]

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        read.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    bounded = None

    async def through_its_route():  # as a BoundedRoute hands it on (http/body_bounds.py)
        nonlocal bounded
        if bounded is None:  # made on the loop that reads it
            bounded = bounded_receive(receive, MAX_BODY_BYTES, 5.0, len(body) if declared else None)
        return await bounded()

    headers = [(b"authorization", credential.encode())]
    if declared:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    return Request(scope, through_its_route), read


def body_of(size: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * max(size - 30, 0)}).encode()


@pytest.mark.parametrize("size, declared", [(4096, True), (200, False)])
def test_a_key_at_its_limits_is_refused_before_a_large_or_undeclared_body_is_read(size, declared):
    gateway = Gateway(full=True)
    http, read = request(body_of(size), declared)
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(Front(gateway)._read(http, RequestRecord("openai", "x")))
    assert refused.value.status == 429 and gateway.asked == 1 and read == []  # not a byte read


def test_a_large_body_of_a_key_with_room_is_read_and_parsed():
    gateway = Gateway(full=False)
    http, read = request(body_of(4096))
    key, body, size = asyncio.run(Front(gateway)._read(http, RequestRecord("openai", "x")))
    assert key is KEY and body["model"] == "m" and size == sum(read) and gateway.asked == 1


def test_a_small_declared_body_costs_no_extra_round_trip():
    gateway = Gateway(full=True)  # its admission refuses it, after a parse of under room_check_bytes
    http, _ = request(body_of(512))
    _, body, _ = asyncio.run(Front(gateway)._read(http, RequestRecord("openai", "x")))
    assert body["model"] == "m" and gateway.asked == 0


def test_no_credential_no_check_and_no_body_read():
    gateway = Gateway(full=False)
    http, read = request(body_of(4096), credential="Bearer wrong")
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(Front(gateway)._read(http, RequestRecord("openai", "x")))
    assert refused.value.status == 401 and gateway.asked == 0 and read == []


# A large body read and then refused for the client's own mistake counts as a request
# of its key (Gateway.count_refused_read), so reading such bodies is never free work.


class Telemetry:
    def finish(self, record):
        pass


class Counting(Gateway):
    def __init__(self, refusal: OpenAIError | None, admitted: bool = False):
        super().__init__(full=False)
        self.refusal, self.admitted, self.counted = refusal, admitted, 0

    async def count_refused_read(self, key):
        assert key is KEY
        self.counted += 1

    async def run(self, key, operation, body, size, record, **kwargs):
        if self.admitted:
            record.admitted_at = 1.0  # what Telemetry.admitted marks
        if self.refusal is not None:
            raise self.refusal
        return "answer"


class Call:
    operation, bytes_once_admitted, once_admitted, abandon = "chat", 0, None, None

    def __init__(self, body):
        self.body = body

    def respond(self, reply):
        from starlette.responses import JSONResponse

        return JSONResponse({"reply": reply})


async def as_call(body, key):
    if body.get("bad"):
        raise OpenAIError(400, "a bad field", param="bad")
    return Call(body)


def counted(gateway: Counting, raw: bytes, declared: bool = True) -> tuple[int, int]:
    front = Front(gateway)
    front.telemetry = Telemetry()  # type: ignore[assignment]
    http, _ = request(raw, declared)
    response = asyncio.run(front._handle("openai", http, as_call))
    return response.status_code, gateway.counted


@pytest.mark.parametrize(
    "raw, refusal, admitted, expected",
    [
        (body_of(4096), OpenAIError(400, "bad role", param="messages"), False, (400, 1)),  # the gateway's 400
        (body_of(4096), OpenAIError(404, "no such model", param="model"), False, (404, 1)),
        (body_of(4096)[:-1], None, False, (400, 1)),  # not JSON
        (json.dumps({"model": "m", "bad": "x" * 4096}).encode(), None, False, (400, 1)),  # the dialect's 400
        (body_of(2 << 20), None, False, (413, 1)),  # past the body limit
        (body_of(512), OpenAIError(400, "bad role", param="messages"), False, (400, 0)),  # small: no extra trip
        (body_of(4096), OpenAIError(429, "tokens", code="rate_limit_exceeded"), False, (429, 0)),  # a refusal
        (body_of(4096), OpenAIError(400, "vLLM's 400 after admission"), True, (400, 0)),  # its admission counted it
        (body_of(4096), OpenAIError(503, "ours", code="gateway_overloaded"), False, (503, 0)),  # not the client's
        (body_of(4096), None, False, (200, 0)),  # admitted and answered: counted by its admission
    ],
    ids=["400", "404", "not-json", "dialect-400", "413", "small", "429", "admitted", "503", "answered"],
)
def test_a_large_body_refused_for_the_clients_mistake_counts_as_a_request(raw, refusal, admitted, expected):
    assert counted(Counting(refusal, admitted), raw) == expected


def test_an_undeclared_body_refused_counts_as_a_request():
    assert counted(Counting(None), b"{not json", declared=False) == (400, 1)
