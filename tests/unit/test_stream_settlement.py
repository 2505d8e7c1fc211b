"""How a relayed stream is settled (wiring of ``Gateway._stream``; the replica
side is faked, the relay is the real one): a stream the client drops before its
first byte is still settled; a stream that fails is charged what it delivered."""

import asyncio
import contextlib
import gc
from types import SimpleNamespace

from cache_secret import salts

from contract.model_config import ModelConfig
from contract.replica_wire import StreamStart, Usage
from serve_app.admission.seam import Ticket
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway, _Plan
from serve_app.pipeline.replica_request import GatewayFields
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.wire.api_requests import OPERATIONS
from serve_app.wire.reservation import Reservation

ROLE = 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
TOKEN = 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


class FakeChunks:
    """The replica's stream: ``items`` after the first, then ``ending`` (an
    exception to raise, or nothing: the stream ends)."""

    def __init__(self, items=(), ending: Exception | None = None):
        self.cancelled = False
        self.items = list(items)
        self.ending = ending

    async def _fetch_future_result_async(self):
        return None

    async def __anext__(self):
        return StreamStart("r1", ROLE)

    def __aiter__(self):
        return self._rest()

    async def _rest(self):
        for item in self.items:
            yield item
        if getattr(self, "still_ending", False):
            await asyncio.sleep(3600)  # the replica has sent everything but not ended its stream yet
        if self.ending is not None:
            raise self.ending

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
            self.usage = usage

    def running(self, ticket, replica=""):
        pass


def streaming_gateway(chunks=None):
    access = RecordingAccess()
    gateway = Gateway(access, {}, [ModelConfig(name="tiny-llama")], Telemetry(False, False), salts())
    ticket = Ticket(KeyRecord(id="k1", name="n", created_at=0), "k1-0", "tiny-llama")
    return access, gateway, chunks or FakeChunks(), ticket


RESERVED = Reservation(prompt=7, completion_per_choice=100, choices=1)


def stream_once(gateway, chunks, ticket):
    handle = SimpleNamespace(options=lambda **_: SimpleNamespace(stream=SimpleNamespace(remote=lambda *a, **k: chunks)))
    request = SimpleNamespace(stream_options=None)
    body = {"model": "tiny-llama", "messages": []}
    plan = _Plan(
        OPERATIONS["chat"],
        request,
        body,
        "tiny-llama",
        handle,
        ModelConfig(name="tiny-llama"),
        RESERVED,
        rank=1,
        tier="normal",
        sets=GatewayFields("tiny-llama"),
        streaming=True,
    )
    return gateway._call_streamed(plan, ticket, RequestRecord("openai", "x"), early=None)


async def relay_all(gateway, chunks, ticket) -> str:
    reply = await stream_once(gateway, chunks, ticket)
    return "".join([item async for item in reply.stream])


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


async def test_a_stream_cut_by_a_dead_replica_ends_in_an_error_event_and_is_charged_what_it_delivered():
    from ray.exceptions import ActorDiedError

    access, gateway, chunks, ticket = streaming_gateway(FakeChunks([TOKEN * 3, TOKEN * 2], ActorDiedError()))
    relayed = await relay_all(gateway, chunks, ticket)
    assert relayed.count(TOKEN) == 5 and relayed.endswith('"code": null}}\n\n') and '"error"' in relayed
    assert access.settled == ["failed"] and chunks.cancelled
    assert access.usage == Usage(prompt_tokens=7, completion_tokens=5)  # not the 107 reserved


async def test_a_stream_vllm_ended_with_an_error_event_is_failed_and_charged_what_it_delivered():
    error = 'data: {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}\n\n'
    access, gateway, chunks, ticket = streaming_gateway(FakeChunks([TOKEN * 2, error + "data: [DONE]\n\n"]))
    relayed = await relay_all(gateway, chunks, ticket)
    assert relayed.endswith(error + "data: [DONE]\n\n")  # the client sees vLLM's error event
    assert access.settled == ["failed"]
    assert access.usage == Usage(prompt_tokens=7, completion_tokens=2)


async def test_a_complete_stream_is_charged_its_reported_usage():
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}\n\n'
    access, gateway, chunks, ticket = streaming_gateway(FakeChunks([TOKEN * 2, usage + "data: [DONE]\n\n"]))
    relayed = await relay_all(gateway, chunks, ticket)
    assert '"usage"' not in relayed and relayed.endswith("data: [DONE]\n\n")  # the client did not ask for usage
    assert access.settled == ["completed"] and access.usage == Usage(prompt_tokens=3, completion_tokens=2)


async def test_a_client_that_hangs_up_at_done_while_the_replica_stream_ends_is_charged_its_usage():
    # The openai SDK closes the connection as soon as it reads [DONE]; the replica's
    # stream may not have ended yet. Not a cancelled stream: everything was delivered.
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}\n\n'
    chunks = FakeChunks([TOKEN * 2, usage + "data: [DONE]\n\n"], ending=None)
    chunks.still_ending = True
    access, gateway, chunks, ticket = streaming_gateway(chunks)
    reply = await stream_once(gateway, chunks, ticket)
    relay = reply.stream
    async for item in relay:
        if item.endswith("data: [DONE]\n\n"):
            break
    # As the ASGI server does: the last item sent, it asks for the next one (the relay
    # waits for the replica's stream to end), then the client disconnects and the
    # server cancels the response.
    pending = asyncio.ensure_future(relay.__anext__())
    await asyncio.sleep(0.05)
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    assert access.settled == ["completed"] and access.usage == Usage(prompt_tokens=3, completion_tokens=2)
    assert chunks.cancelled  # what is left of the replica's stream is withdrawn


async def test_a_replica_lost_after_the_final_usage_event_leaves_a_complete_stream():
    from ray.exceptions import ActorDiedError

    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}\n\n'
    access, gateway, chunks, ticket = streaming_gateway(
        FakeChunks([TOKEN * 2, usage + "data: [DONE]\n\n"], ActorDiedError())
    )
    relayed = await relay_all(gateway, chunks, ticket)
    assert relayed.endswith("data: [DONE]\n\n") and '"error"' not in relayed
    assert access.settled == ["completed"] and access.usage == Usage(prompt_tokens=3, completion_tokens=2)


def anthropic_event(name: str, data: str) -> str:
    return f"event: {name}\ndata: {data}\n\n"


async def test_an_anthropic_stream_asks_nothing_of_openai_and_is_charged_its_message_delta_usage():
    delta = anthropic_event("content_block_delta", '{"type": "content_block_delta", "delta": {"text": "x"}}')
    end = anthropic_event(
        "message_delta", '{"type": "message_delta", "usage": {"input_tokens": 9, "output_tokens": 3}}'
    ) + anthropic_event("message_stop", '{"type": "message_stop"}')
    access, gateway, chunks, ticket = streaming_gateway(FakeChunks([delta * 3, end]))
    sent = []
    handle = SimpleNamespace(
        options=lambda **_: SimpleNamespace(
            stream=SimpleNamespace(remote=lambda *args, **kwargs: sent.append(args) or chunks)
        )
    )
    body = {"model": "tiny-llama", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    plan = _Plan(
        OPERATIONS["messages"],
        SimpleNamespace(),
        body,
        "tiny-llama",
        handle,
        ModelConfig(name="tiny-llama"),
        RESERVED,
        rank=1,
        tier="normal",
        sets=GatewayFields("tiny-llama"),
        streaming=True,
    )
    reply = await gateway._call_streamed(plan, ticket, RequestRecord("anthropic", "x"), early=None)
    relayed = "".join([item async for item in reply.stream])
    assert relayed.endswith(end)  # passed on whole: Anthropic's client reads the usage itself
    assert sent == [("messages", body)] and "stream_options" not in body  # vLLM's Anthropic request has none
    assert access.settled == ["completed"] and access.usage == Usage(prompt_tokens=9, completion_tokens=3)


async def test_a_stream_whose_key_is_revoked_ends_with_a_key_error_and_is_charged_what_it_delivered():
    class EndlessChunks(FakeChunks):
        """A replica stream that yields tokens until it is cancelled."""

        async def _rest(self):
            while not self.cancelled:
                yield TOKEN
                await asyncio.sleep(0.01)

    access, gateway, chunks, ticket = streaming_gateway(EndlessChunks())
    reply = await stream_once(gateway, chunks, ticket)
    relayed = []
    async for item in reply.stream:
        relayed.append(item)
        if len(relayed) == 4:
            ticket.revoked = True  # what Access.stop_revoked does when the key's record says revoked
    assert chunks.cancelled and '"code": "invalid_api_key"' in relayed[-1] and len(relayed) == 5
    assert access.settled == ["failed"]
    assert access.usage == Usage(prompt_tokens=7, completion_tokens=3)  # the three tokens it delivered
