"""Virtual-token-counter order at the gateway (serve_app/fair_share.py): pure
bookkeeping on recorded sequences, and the gate's waiting, cancelling and
releasing on a real event loop (no Serve: what the gate guards is faked as a
replica slot that frees when the test says so)."""

import asyncio

import pytest

from serve_app.fair_share import FairGate, TokenWeights, VirtualTokenCounter

WEIGHTS = TokenWeights(prompt=1.0, completion=2.0)


def test_the_lowest_counter_goes_first_and_the_oldest_key_wins_a_tie():
    vtc = VirtualTokenCounter(WEIGHTS)
    vtc.charge("heavy", 100, 50)  # 200
    vtc.charge("light", 10, 5)  # 20
    assert vtc.next_key({"heavy": 1, "light": 1}) == "light"
    vtc.charge("light", 0, 100)  # 220
    assert vtc.next_key({"heavy": 1, "light": 1}) == "heavy"
    vtc.charge("light", 0, -10)  # 200: a tie
    assert vtc.next_key({"heavy": 1, "light": 1}) == "heavy"  # waiting first (dict order)


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


class Model:
    """Replica slots: a request handed on holds one until the test frees it."""

    def __init__(self, gate: FairGate):
        self.gate = gate
        self.order: list[str] = []
        self.free = asyncio.Event()

    async def request(self, key: str, tier: int = 1, prompt: int = 10, completion: int = 50):
        async with self.gate.turn(key, tier, prompt):
            self.order.append(key)  # handed on, and (here at once) taken by a replica
        self.gate.served(key, prompt, prompt, completion)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_model_with_room_hands_requests_on_without_waiting():
    gate = FairGate(window=4, counter=VirtualTokenCounter(WEIGHTS))
    entered = []

    async def hold(key):
        async with gate.turn(key, 1, 10):
            entered.append(key)
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(hold(f"k{i}")) for i in range(4)]
    await settle()
    assert len(entered) == 4 and gate.waiting == 0
    await asyncio.gather(*tasks)
    assert gate.handed_on == 0


async def test_a_light_key_overtakes_a_heavy_keys_backlog():
    gate = FairGate(window=1, counter=VirtualTokenCounter(WEIGHTS))
    order = []
    release = asyncio.Event()

    async def request(key):
        async with gate.turn(key, 1, 10):
            order.append(key)
            if len(order) == 1:
                await release.wait()  # the model is busy with the first one
        gate.served(key, 10, 10, 50)

    heavy = [asyncio.create_task(request("heavy")) for _ in range(8)]
    await settle()
    light = asyncio.create_task(request("light"))
    await settle()
    assert order == ["heavy"] and gate.waiting == 8
    release.set()
    await asyncio.gather(*heavy, light)
    assert order.index("light") <= 2, order  # FCFS would have made it 9th


async def test_a_request_cancelled_while_waiting_leaves_no_trace():
    gate = FairGate(window=1, counter=VirtualTokenCounter(WEIGHTS))
    release = asyncio.Event()

    async def hold():
        async with gate.turn("a", 1, 10):
            await release.wait()

    first = asyncio.create_task(hold())
    await settle()
    waiting = asyncio.create_task(hold())
    await settle()
    assert gate.waiting == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.waiting == 0
    release.set()
    await first
    assert gate.handed_on == 0 and not gate._queues


async def test_a_request_granted_as_it_is_cancelled_passes_its_place_on():
    gate = FairGate(window=1, counter=VirtualTokenCounter(WEIGHTS))
    release = asyncio.Event()
    entered = []

    async def hold(name):
        async with gate.turn(name, 1, 10):
            entered.append(name)
            await release.wait()

    async def first_then_cancel_the_second():
        await hold("first")
        second.cancel()  # granted its place as the first left, but not yet running

    first = asyncio.create_task(first_then_cancel_the_second())
    await settle()
    second = asyncio.create_task(hold("second"))
    third = asyncio.create_task(hold("third"))
    await settle()
    assert gate.waiting == 2
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second, third, return_exceptions=True), 5)
    assert second.cancelled() and entered == ["first", "third"]
    assert gate.handed_on == 0 and gate.waiting == 0
