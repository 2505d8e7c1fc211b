"""Fair share between keys while a model is saturated: Virtual Token Counter
order (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24).

Each key has a counter of the tokens it was served, prefill and decode weighted.
While the model's replicas are all busy, its requests wait here, at the ingress,
and the next one handed on to Serve is the oldest request of the waiting key with
the lowest counter (a higher priority tier first). A key that starts waiting has
its counter lifted to the lowest counter among the keys already waiting, so
being idle banks no credit; a heavy key therefore cannot starve a light one, and
a light one cannot monopolise the model after a quiet hour.

Work-conserving: requests are handed on at once while the model's replicas have
places (the sum of their ``max_ongoing_requests``, as this ingress' router sees
them: serve_app/routing/serve_routers.py), so a model with room serves anyone at full speed.
Only when every place is taken by this ingress' requests do new ones wait, and
each place that frees goes to the next in fair order, straight to the replica
that has it (nothing waits in Serve's own queue, first come first served, and
polled with backoff). A model with no replica (scale from zero) or whose places
are not known yet lets requests through: Serve's queue wakes its autoscaler.

The last ``light_key_places`` places (2 by default) are kept for light keys:
a key with fewer requests than that in flight may take any place, a key with
more fills every place but those. So a light key's request (up to that many at a
time) reaches the engine at once and is batched with the heavy key's, instead of
waiting for one of them to end (in the engine's batch is where the paper orders;
a place freed comes only every stream-length / places). The engine keeps running
while anyone waits, on that many places less for the heavy key.

Counters are charged what a request used when it ends (prompt and completion
tokens as the engine counted them; a cancelled stream, what was relayed), not an
estimate when it starts: with short requests an estimate's error outweighs what
they use and reorders keys. A key's counter so lags by at most its requests in
flight, which the model's places bound. Memory is bounded: counters of keys with
nothing waiting and no lead over the lowest waiting counter carry no information
(the lift would raise them anyway) and are dropped past ``max_keys``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Container
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenWeights:
    prompt: float = 1.0
    completion: float = 2.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return self.prompt * prompt_tokens + self.completion * completion_tokens


class VirtualTokenCounter:
    """The counters, and which waiting key goes next: pure bookkeeping."""

    def __init__(self, weights: TokenWeights, max_keys: int = 10_000):
        self.weights = weights
        self.max_keys = max_keys
        self.counters: dict[str, float] = {}
        self._floor = 0.0  # the counter of the key served last: where a key that starts waiting alone begins
        self._last_turn: dict[str, int] = {}  # when each key last had a request handed on (a sequence number)
        self._turns = 0

    def counter(self, key: str) -> float:
        return self.counters.get(key, self._floor)

    def lift(self, key: str, waiting_keys: list[str]) -> None:
        """``key`` starts waiting: no lower than the lowest of the keys already waiting
        (the last served one's when none waits)."""
        lowest = min((self.counter(other) for other in waiting_keys if other != key), default=self._floor)
        self.counters[key] = max(self.counter(key), lowest)

    def charge(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.counters[key] = self.counter(key) + self.weights.cost(prompt_tokens, completion_tokens)

    def took_turn(self, key: str) -> None:
        """A request of ``key`` was handed on."""
        self._turns += 1
        self._last_turn[key] = self._turns

    def next_key(self, waiting: dict[str, int]) -> str:
        """Of the waiting keys (key -> tier rank, 0 first), the one served next: the
        lowest counter of the highest tier; on a tie, the key whose last turn is
        oldest (a key just lifted to the others' counter goes before them)."""
        key = min(waiting, key=lambda k: (waiting[k], self.counter(k), self._last_turn.get(k, 0)))
        self._floor = self.counter(key)
        return key

    def forget_idle(self, waiting_keys: Container[str]) -> None:
        """Past ``max_keys``: drop the counters no lift would keep (at or below the floor)."""
        if len(self.counters) <= self.max_keys:
            return
        for key in [k for k, c in self.counters.items() if k not in waiting_keys and c <= self._floor]:
            del self.counters[key]
            self._last_turn.pop(key, None)


@dataclass
class _Waiter:
    key: str
    tier: int
    granted: asyncio.Future


class Place:
    """A request's place among the model's in flight; ``leave`` (idempotent) frees it."""

    __slots__ = ("_gate", "_key")

    def __init__(self, gate: FairShareQueue, key: str):
        self._gate: FairShareQueue | None = gate
        self._key = key

    def leave(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._left(self._key)


class FairShareQueue:
    """One model's requests in flight from this ingress, and those waiting for a place."""

    def __init__(self, places: Callable[[], int | None], counter: VirtualTokenCounter, light_key_places: int = 0):
        self.places = places
        self.vtc = counter
        self.light_key_places = light_key_places
        self.in_flight = 0  # handed on and not finished
        self._by_key: collections.Counter[str] = collections.Counter()  # in flight, per key
        self._queues: dict[str, collections.deque[_Waiter]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def enter(self, key: str, tier: int) -> Place:
        """Returns once the request may be handed on: at once while a place is free
        and nobody waits, else in fair order as places free."""
        place = self.enter_now(key)
        if place is None:
            await self._wait(key, tier)
            place = Place(self, key)
        return place

    def enter_now(self, key: str) -> Place | None:
        """A place at once, if one is free and nobody waits; else None (and no place taken)."""
        if key not in self._queues:
            self.vtc.lift(key, list(self._queues))
        if self._queues or not self._room(key):
            return None
        self._hand_on(key)
        return Place(self, key)

    def served(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended having used this: charged to its key's counter."""
        self.vtc.charge(key, prompt_tokens, completion_tokens)

    def _room(self, key: str) -> bool:
        """Whether a request of ``key`` may be handed on now. The last
        ``light_key_places`` places are kept for keys with fewer requests than
        that in flight."""
        places = self.places()
        if not places:  # unknown or none (scale from zero): Serve queues
            return True
        light = self._by_key[key] < self.light_key_places
        kept = 0 if light else min(self.light_key_places, places - 1)
        return self.in_flight < places - kept

    def _hand_on(self, key: str) -> None:
        self.in_flight += 1
        self._by_key[key] += 1
        self.vtc.took_turn(key)

    def _left(self, key: str) -> None:
        self.in_flight -= 1
        self._by_key[key] -= 1
        if not self._by_key[key]:
            del self._by_key[key]  # bounded by the keys in flight
        self._release()

    async def _wait(self, key: str, tier: int) -> None:
        waiter = _Waiter(key, tier, asyncio.get_running_loop().create_future())
        self._queues.setdefault(key, collections.deque()).append(waiter)
        self._release()  # places may have grown since the last one left (a replica added)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._left(key)  # granted as it was cancelled: the place goes to the next one
            else:
                self._remove(waiter)
            raise

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.key]

    def _release(self) -> None:
        while self._queues:
            # Of the waiting keys that may take a place now (a light key may take
            # a kept one), the next in fair order.
            eligible = {k: queue[0].tier for k, queue in self._queues.items() if self._room(k)}
            if not eligible:
                break
            key = self.vtc.next_key(eligible)
            queue = self._queues[key]
            waiter = queue.popleft()
            if not queue:
                del self._queues[key]
            if waiter.granted.done():  # cancelled while waiting, not yet removed
                continue
            self._hand_on(key)
            waiter.granted.set_result(None)
        self.vtc.forget_idle(self._queues.keys())  # a view: nothing built per release
