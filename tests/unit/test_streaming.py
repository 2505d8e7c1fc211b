"""Pure logic: coalescing a stream never loses, reorders or holds back events;
asking vLLM for several tokens per chunk only beside other streams."""

import asyncio

import pytest

from replicas.streaming import batch_tokens, coalesce


async def produce(items, delay=0.0):
    for item in items:
        if delay:
            await asyncio.sleep(delay)
        yield item


async def collect(source, **kwargs):
    return [item async for item in coalesce(source, **kwargs)]


async def test_slow_consumer_gets_joined_items_in_order():
    items = [f"data: {i}\n\n" for i in range(50)]
    out = []
    async for part in coalesce(produce(items)):
        out.append(part)
        await asyncio.sleep(0.001)  # the consumer is slower than the source
    assert "".join(out) == "".join(items)
    assert len(out) < len(items)


async def test_first_item_is_not_held_back():
    gate = asyncio.Event()

    async def source():
        yield "first"
        await gate.wait()
        yield "second"

    stream = coalesce(source(), interval_s=0.5)
    assert await asyncio.wait_for(stream.__anext__(), timeout=0.2) == "first"
    gate.set()
    assert [x async for x in stream] == ["second"]


async def test_interval_joins_events_that_arrive_within_it():
    out = await collect(produce(["a", "b", "c", "d"], delay=0.01), interval_s=0.1)
    assert out[0] == "a" and "".join(out) == "abcd" and len(out) == 2


async def test_source_error_reaches_the_consumer_after_earlier_items():
    async def failing():
        yield "ok"
        raise ValueError("engine died")

    stream = coalesce(failing())
    assert await stream.__anext__() == "ok"
    with pytest.raises(ValueError, match="engine died"):
        await stream.__anext__()


async def test_closing_the_stream_cancels_the_source():
    cancelled = asyncio.Event()

    async def endless():
        try:
            while True:
                yield "tok"
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    stream = coalesce(endless())
    await stream.__anext__()
    await stream.aclose()
    assert cancelled.is_set()


async def test_the_end_of_a_stream_is_not_held_for_the_interval():
    # An hour's interval: the stream's last items (vLLM's usage and [DONE]) still
    # come out as soon as the source ends, joined into one item.
    loop = asyncio.get_running_loop()
    started = loop.time()
    out = await asyncio.wait_for(collect(produce(["a", "b", "c", "[DONE]"], delay=0.01), interval_s=3600), timeout=30)
    assert out == ["a", "bc[DONE]"]
    assert loop.time() - started < 30


async def test_the_interval_is_waited_only_while_busy_says_so():
    items = ["a", "b", "c", "d"]
    alone = await asyncio.wait_for(collect(produce(items, delay=0.01), interval_s=3600, busy=lambda: False), 5)
    assert alone == items  # each as it came: nothing waited for company
    beside = await collect(produce(items, delay=0.01), interval_s=0.1, busy=lambda: True)
    assert beside == ["a", "bcd"]


CHAT = {"model": "m", "messages": [], "stream": True}


def test_tokens_are_batched_only_beside_other_streams():
    assert batch_tokens("chat", CHAT, 4, others=False) is CHAT  # a lone stream: every token as it comes
    batched = batch_tokens("chat", CHAT, 4, others=True)
    assert batched["stream_interval"] == 4 and "stream_interval" not in CHAT  # the caller's body is not touched
    assert batch_tokens("completions", {"prompt": "x"}, 4, others=True)["stream_interval"] == 4
    assert batch_tokens("chat", CHAT, 1, others=True) is CHAT  # 1 turns it off


@pytest.mark.parametrize("operation", ["embeddings", "messages", "responses", "score"])
def test_operations_without_a_stream_interval_are_left_alone(operation):
    body = {"model": "m"}
    assert batch_tokens(operation, body, 4, others=True) is body  # vLLM would refuse the unknown field


@pytest.mark.parametrize("asked, sent", [(1, 4), (3, 4), (4, 4), (16, 16), (10**12, 10**12)])
def test_a_clients_larger_interval_stands_and_a_smaller_one_is_raised(asked, sent):
    assert batch_tokens("chat", {**CHAT, "stream_interval": asked}, 4, others=True)["stream_interval"] == sent


@pytest.mark.parametrize("asked", ["4", 2.5, True, [4], {"n": 4}, 0, -3])
def test_an_interval_that_is_not_a_valid_whole_number_is_left_for_vllm_to_refuse(asked):
    body = {**CHAT, "stream_interval": asked}
    # Replaced only when busy, a bad value would be a 400 alone and accepted beside others.
    assert batch_tokens("chat", body, 4, others=True)["stream_interval"] is asked
