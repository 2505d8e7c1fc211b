"""A stream the client drops before its first byte is still settled (wiring of
``Gateway._stream``; the replica side is faked, the relay is the real one)."""

import asyncio
import gc
from types import SimpleNamespace

from replicas.config import ModelConfig
from serve_app.access import Ticket
from serve_app.api_requests import OPERATIONS
from serve_app.gateway import Gateway
from serve_app.keys import KeyRecord
from serve_app.telemetry import RequestRecord, Telemetry


class FakeChunks:
    def __init__(self):
        self.cancelled = False

    async def _fetch_future_result_async(self):
        return None

    async def __anext__(self):
        return ': replica=r1\n\ndata: {"choices": []}\n\n'

    def cancel(self):
        self.cancelled = True


class RecordingAccess:
    default_max_tokens = 16

    def __init__(self):
        self.settled = []

    def settle(self, ticket, status, usage=None, replica=""):
        if not ticket.settled:
            ticket.settled = True
            self.settled.append(status)

    def running(self, ticket, replica=""):
        pass


def streaming_gateway():
    access = RecordingAccess()
    gateway = Gateway(access, {}, [ModelConfig(name="tiny-llama")], Telemetry(False, False))
    ticket = Ticket(KeyRecord(id="k1", name="n", created_at=0), "k1-0", "tiny-llama")
    return access, gateway, FakeChunks(), ticket


def stream_once(gateway, chunks, ticket):
    handle = SimpleNamespace(options=lambda **_: SimpleNamespace(stream=SimpleNamespace(remote=lambda *a: chunks)))
    request = SimpleNamespace(stream_options=None)
    body = {"model": "tiny-llama", "messages": []}
    return gateway._stream(handle, OPERATIONS["chat"], body, request, ticket, 5, RequestRecord("openai", "x"))


async def test_an_unstarted_stream_dropped_by_its_client_is_settled_once():
    access, gateway, chunks, ticket = streaming_gateway()
    reply = await stream_once(gateway, chunks, ticket)
    assert access.settled == []
    del reply  # Starlette never iterated it: the client was gone
    gc.collect()
    assert access.settled == ["cancelled"] and chunks.cancelled


async def test_a_relayed_stream_is_settled_by_the_relay_alone():
    access, gateway, chunks, ticket = streaming_gateway()
    reply = await stream_once(gateway, chunks, ticket)
    relay = reply.stream
    assert await relay.__anext__()  # the first chunk is out
    await relay.aclose()  # the client hung up mid-stream: the relay's finally settles
    del reply, relay
    gc.collect()
    await asyncio.sleep(0)
    assert access.settled == ["cancelled"]
