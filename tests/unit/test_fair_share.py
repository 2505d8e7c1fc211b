"""Virtual-token-counter order at the gateway (serve_app/pipeline/fair_share.py): pure
bookkeeping on recorded sequences, and the gate's waiting, cancelling and
releasing on a real event loop (no Serve: what the gate guards is faked as a
replica slot that frees when the test says so)."""

import asyncio

import pytest

from serve_app.pipeline.fair_share import FairShareQueue, TokenWeights, VirtualTokenCounter

WEIGHTS = TokenWeights(prompt=1.0, completion=2.0)


def test_the_lowest_counter_goes_first():
    vtc = VirtualTokenCounter(WEIGHTS)
    vtc.charge("heavy", 100, 50)  # 200
    vtc.charge("light", 10, 5)  # 20
    assert vtc.next_key({"heavy": 1, "light": 1}) == "light"
    vtc.charge("light", 0, 100)  # 220
    assert vtc.next_key({"heavy": 1, "light": 1}) == "heavy"


def test_on_a_tie_the_key_whose_last_turn_is_oldest_goes_first():
    vtc = VirtualTokenCounter(WEIGHTS)
    for _ in range(5):
        vtc.charge("heavy", 40, 0)
        vtc.took_turn("heavy")
    vtc.lift("light", ["heavy"])  # starts waiting: lifted to the heavy key's 200, never had a turn
    assert vtc.counter("light") == vtc.counter("heavy")
    assert vtc.next_key({"heavy": 1, "light": 1}) == "light"
    vtc.took_turn("light")
    assert vtc.next_key({"heavy": 1, "light": 1}) == "heavy"  # still tied: now the heavy key's turn is older


def test_a_higher_tier_goes_first_whatever_its_counter():
    vtc = VirtualTokenCounter(WEIGHTS)
    vtc.charge("vip", 10_000, 0)
    assert vtc.next_key({"vip": 0, "light": 1}) == "vip"


def test_idle_time_banks_no_credit():
    vtc = VirtualTokenCounter(WEIGHTS)
    vtc.charge("busy", 5_000, 0)
    vtc.lift("returning", ["busy"])  # was idle with counter 0 while busy ran up 5,000
    assert vtc.counter("returning") == 5_000
    vtc.lift("busy", ["returning"])
    assert vtc.counter("busy") == 5_000  # lifting never lowers


def test_a_new_key_starts_at_the_last_served_counter():
    vtc = VirtualTokenCounter(WEIGHTS)
    vtc.charge("a", 300, 0)
    vtc.next_key({"a": 1})
    assert vtc.counter("never-seen") == 300


def test_counters_stay_bounded_over_many_keys():
    vtc = VirtualTokenCounter(WEIGHTS, max_keys=100)
    for number in range(10_000):
        key = f"k{number}"
        vtc.lift(key, [])
        vtc.next_key({key: 1})  # served; nothing stays ahead of the floor
        vtc.forget_idle(set())
    assert len(vtc.counters) <= 101


def test_backlogged_keys_share_tokens_evenly_whatever_their_request_rate():
    """A recorded sequence: the heavy key always has 8 requests waiting, the light
    key 1; every request is 10 prompt + 50 completion tokens. Served in counter
    order, the two get the same tokens within one request's cost."""
    vtc = VirtualTokenCounter(WEIGHTS)
    served = {"heavy": 0, "light": 0}
    for _ in range(200):
        key = vtc.next_key({"heavy": 1, "light": 1})
        vtc.charge(key, 10, 50)
        served[key] += 1
    assert abs(served["heavy"] - served["light"]) <= 1


# -- the gate ---------------------------------------------------------------------


def gate_with(places: int | None) -> FairShareQueue:
    return FairShareQueue(lambda: places, VirtualTokenCounter(WEIGHTS))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_model_with_places_free_hands_requests_on_without_waiting():
    gate = gate_with(4)
    places = [await gate.enter(f"k{i}", 1) for i in range(4)]
    assert gate.in_flight == 4 and gate.waiting == 0
    for place in places:
        place.leave()
        place.leave()  # idempotent: a ticket is settled once, but say it twice
    assert gate.in_flight == 0


@pytest.mark.parametrize("places", [None, 0])
async def test_unknown_places_or_none_at_all_let_everything_through(places):
    # Not known yet (no router has seen the replicas), or scale from zero: Serve's
    # own queue must see the requests, or its autoscaler never adds a replica.
    gate = gate_with(places)
    await asyncio.wait_for(asyncio.gather(*(gate.enter("k", 1) for _ in range(50))), 1)
    assert gate.in_flight == 50 and gate.waiting == 0


async def test_a_light_key_overtakes_a_heavy_keys_backlog():
    gate = gate_with(1)
    order = []

    async def request(key):
        place = await gate.enter(key, 1)
        order.append(key)
        return place

    running = await request("heavy")  # the one place
    heavy = [asyncio.create_task(request("heavy")) for _ in range(8)]
    await settle()
    light = asyncio.create_task(request("light"))
    await settle()
    assert order == ["heavy"] and gate.waiting == 9
    gate.served("heavy", 10, 50)
    running.leave()  # each place that frees goes to the next in fair order
    waiting = [*heavy, light]
    while waiting:
        await settle()
        [granted] = [task for task in waiting if task.done()]  # one place: one at a time
        waiting.remove(granted)
        gate.served(order[-1], 10, 50)
        granted.result().leave()
    assert order.index("light") == 1, order  # next; first come, first served would have made it 10th


async def test_a_place_freed_goes_to_a_higher_tier_first():
    gate = gate_with(1)
    running = await gate.enter("a", 1)
    low = asyncio.create_task(gate.enter("low", 2))
    high = asyncio.create_task(gate.enter("high", 0))
    await settle()
    running.leave()
    await settle()
    assert high.done() and not low.done()
    high.result().leave()
    await settle()
    assert low.done()


async def test_a_request_cancelled_while_waiting_leaves_no_trace():
    gate = gate_with(1)
    first = await gate.enter("a", 1)
    waiting = asyncio.create_task(gate.enter("a", 1))
    await settle()
    assert gate.waiting == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.waiting == 0
    first.leave()
    assert gate.in_flight == 0 and not gate._queues


async def test_a_request_granted_as_it_is_cancelled_passes_its_place_on():
    gate = gate_with(1)
    first = await gate.enter("first", 1)
    second = asyncio.create_task(gate.enter("second", 1))
    third = asyncio.create_task(gate.enter("third", 1))
    await settle()
    assert gate.waiting == 2
    first.leave()  # the place is granted to the second ...
    second.cancel()  # ... which is cancelled before it runs again
    await asyncio.wait_for(asyncio.gather(second, third, return_exceptions=True), 5)
    assert second.cancelled() and third.done() and gate.in_flight == 1 and gate.waiting == 0
    third.result().leave()
    assert gate.in_flight == 0


async def test_a_place_added_lets_a_waiting_request_through_on_the_next_arrival():
    places = [1]
    gate = FairShareQueue(lambda: places[0], VirtualTokenCounter(WEIGHTS))
    await gate.enter("a", 1)
    waiting = asyncio.create_task(gate.enter("b", 1))
    await settle()
    places[0] = 3  # a replica added: nothing has left yet
    arriving = asyncio.create_task(gate.enter("c", 1))
    await settle()
    assert waiting.done() and arriving.done() and gate.in_flight == 3


async def test_a_kept_place_lets_a_key_with_nothing_in_flight_start_at_once():
    gate = FairShareQueue(lambda: 4, VirtualTokenCounter(WEIGHTS), light_key_places=1)
    heavy = [await gate.enter("heavy", 1) for _ in range(3)]
    waiting = asyncio.ensure_future(gate.enter("heavy", 1))  # the fourth place is kept
    await settle()
    assert not waiting.done() and gate.in_flight == 3
    light = await asyncio.wait_for(gate.enter("light", 1), 1)  # nothing in flight: takes the kept place
    assert gate.in_flight == 4
    second = asyncio.ensure_future(gate.enter("light", 1))  # one in flight now: waits like anyone
    await settle()
    assert not second.done()
    light.leave()  # the freed place is the kept one again: light (nothing in flight) takes it
    await settle()
    assert second.done() and not waiting.done()
    heavy[0].leave()  # one place stays free (kept) while heavy waits: 3 of 4 run
    await settle()
    assert not waiting.done() and gate.in_flight == 3
    second.result().leave()  # now heavy runs 3 of 4 again
    await settle()
    assert waiting.done() and gate.in_flight == 3
    for place in (*heavy[1:], waiting.result()):
        place.leave()
    assert gate.in_flight == 0 and not gate._by_key


async def test_one_key_alone_leaves_only_the_kept_place_and_one_place_keeps_none():
    gate = FairShareQueue(lambda: 4, VirtualTokenCounter(WEIGHTS), light_key_places=1)
    places = [await gate.enter("only", 1) for _ in range(3)]
    assert gate.in_flight == 3 and not asyncio.ensure_future(gate.enter("only", 1)).done()
    single = FairShareQueue(lambda: 1, VirtualTokenCounter(WEIGHTS), light_key_places=1)
    assert (await asyncio.wait_for(single.enter("only", 1), 1)) is not None  # a place of one is never kept
    for place in places:
        place.leave()


async def test_two_kept_places_let_a_key_streaming_two_at_a_time_start_each_at_once():
    gate = FairShareQueue(lambda: 4, VirtualTokenCounter(WEIGHTS), light_key_places=2)
    heavy = [await gate.enter("heavy", 1) for _ in range(2)]
    backlog = [asyncio.ensure_future(gate.enter("heavy", 1)) for _ in range(3)]  # two places are kept
    await settle()
    assert not any(w.done() for w in backlog) and gate.in_flight == 2
    first = await asyncio.wait_for(gate.enter("light", 1), 1)  # nothing in flight
    second = await asyncio.wait_for(gate.enter("light", 1), 1)  # one in flight: still a light key
    assert gate.in_flight == 4
    third = asyncio.ensure_future(gate.enter("light", 1))  # two in flight: waits like anyone
    await settle()
    assert not third.done()
    first.leave()  # a closed loop's next request: the freed place is kept for it, not for the backlog
    await settle()
    assert third.done() and not any(w.done() for w in backlog)
    heavy[0].leave()  # heavy gets back to its two places, never the kept ones while light runs two
    await settle()
    assert sum(w.done() for w in backlog) == 1 and gate.in_flight == 4
    for place in (second, third.result()):
        place.leave()
    await settle()
    # The light key gone, the heavy key runs on every place but the kept two.
    assert sum(w.done() for w in backlog) == 1 and gate.in_flight == 2


async def test_a_key_is_light_again_once_fewer_than_the_kept_places_are_in_flight():
    gate = FairShareQueue(lambda: 2, VirtualTokenCounter(WEIGHTS), light_key_places=2)
    places = [await gate.enter("only", 1) for _ in range(2)]  # its first two are light: any place
    assert gate.in_flight == 2
    places[0].leave()
    third = asyncio.ensure_future(gate.enter("only", 1))  # one in flight: still light, takes the freed place
    await settle()
    assert third.done()
    places[1].leave()
    third.result().leave()
    heavy = [await gate.enter("many", 1) for _ in range(2)]
    fourth = asyncio.ensure_future(gate.enter("many", 1))  # two in flight, two places: waits
    await settle()
    assert not fourth.done()
    heavy[0].leave()  # one in flight again: a light key, the place is its
    await settle()
    assert fourth.done()
