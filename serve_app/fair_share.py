"""Fair share between keys while a model is saturated: Virtual Token Counter
order (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24).

Each key has a counter of the tokens it was served, prefill and decode weighted.
While the model's replicas are all busy, its requests wait here, at the ingress,
and the next one handed on to Serve is the oldest request of the waiting key with
the lowest counter (a higher priority tier first). A key that starts waiting has
its counter lifted to the lowest counter among the keys already waiting, so
being idle banks no credit; a heavy key therefore cannot starve a light one, and
a light one cannot monopolise the model after a quiet hour.

Work-conserving: up to ``window`` requests are handed to Serve's router at once
without waiting, so a model with room serves anyone at full speed; only the
requests beyond those wait, and only as long as no replica takes one.

Counters are charged when a request is handed on (its estimated prompt) and
corrected when it ends (actual prompt and completion tokens): a key's counter
lags by at most its requests in flight. Memory is bounded: counters of keys with
nothing waiting and no lead over the lowest waiting counter carry no information
(the lift would raise them anyway) and are dropped past ``max_keys``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator


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

    def counter(self, key: str) -> float:
        return self.counters.get(key, self._floor)

    def lift(self, key: str, waiting_keys: list[str]) -> None:
        """``key`` starts waiting: no lower than the lowest of the keys already waiting
        (the last served one's when none waits)."""
        lowest = min((self.counter(other) for other in waiting_keys if other != key), default=self._floor)
        self.counters[key] = max(self.counter(key), lowest)

    def charge(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.counters[key] = self.counter(key) + self.weights.cost(prompt_tokens, completion_tokens)

    def next_key(self, waiting: dict[str, int]) -> str:
        """Of the waiting keys (key -> tier rank, 0 first), the one served next:
        the lowest counter of the highest tier, the longest waiting on a tie."""
        key = min(waiting, key=lambda k: (waiting[k], self.counter(k)))
        self._floor = self.counter(key)
        return key

    def forget_idle(self, waiting_keys: set[str]) -> None:
        """Past ``max_keys``: drop the counters no lift would keep (at or below the floor)."""
        if len(self.counters) <= self.max_keys:
            return
        for key in [k for k, c in self.counters.items() if k not in waiting_keys and c <= self._floor]:
            del self.counters[key]


@dataclass
class _Waiter:
    key: str
    tier: int
    prompt_estimate: int
    granted: asyncio.Future


class FairGate:
    """One model's requests on their way to its replicas, at this ingress."""

    def __init__(self, window: int, counter: VirtualTokenCounter):
        self.window = window
        self.vtc = counter
        self.handed_on = 0  # handed to Serve's router, not yet taken by a replica
        self._queues: dict[str, collections.deque[_Waiter]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    @contextlib.asynccontextmanager
    async def turn(self, key: str, tier: int, prompt_estimate: int) -> AsyncIterator[None]:
        """Holds the request until it may be handed on; the body hands it to Serve
        and returns once a replica took it (or it failed)."""
        if key not in self._queues:
            self.vtc.lift(key, list(self._queues))
        if self.handed_on < self.window and not self._queues:
            self._hand_on(key, prompt_estimate)
        else:
            await self._wait(key, tier, prompt_estimate)
        try:
            yield
        finally:
            self.handed_on -= 1
            self._release()

    def served(self, key: str, prompt_estimate: int, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended with this usage: correct the estimate charged when it was handed on."""
        self.vtc.charge(key, prompt_tokens - prompt_estimate, completion_tokens)

    def _hand_on(self, key: str, prompt_estimate: int) -> None:
        self.handed_on += 1
        self.vtc.charge(key, prompt_estimate, 0)

    async def _wait(self, key: str, tier: int, prompt_estimate: int) -> None:
        waiter = _Waiter(key, tier, prompt_estimate, asyncio.get_running_loop().create_future())
        self._queues.setdefault(key, collections.deque()).append(waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                # Granted as it was cancelled: give the place to the next one.
                self.handed_on -= 1
                self._release()
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
        while self.handed_on < self.window and self._queues:
            key = self.vtc.next_key({k: queue[0].tier for k, queue in self._queues.items()})
            queue = self._queues[key]
            waiter = queue.popleft()
            if not queue:
                del self._queues[key]
            if waiter.granted.done():  # cancelled while waiting, not yet removed
                continue
            self._hand_on(key, waiter.prompt_estimate)
            waiter.granted.set_result(None)
        self.vtc.forget_idle(set(self._queues))
