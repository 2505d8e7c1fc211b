"""When a stream may start in the engine while its admission is still in Redis.

Admission is one Redis round trip, and on a loaded box it is also a wake-up of
the gateway's process for the reply: a request that waits for it before the
engine starts pays both in its time to first token (docs/performance.md).
A key that Redis just admitted with room to spare will almost surely be
admitted again, so its next stream can be handed to the engine at once and
its admission awaited beside the prefill; nothing is sent to the client
before Redis says yes, and a refusal aborts the engine's request.

What a wrong guess costs is engine work, never quota: Redis still decides
every request. So the guess is bounded by what Redis last said, per key and
per process:

- a key is guessed only after Redis admitted it here, and no longer once Redis
  refused it (the next admission with room turns it back on);
- each guess spends the room it assumes (a request of the requests/min left, its
  reservation of the tokens/min and budgets left), so concurrent guesses never
  assume more room than Redis reported;
- a key with a concurrency limit is guessed only while this process runs fewer
  than ``max_concurrent - 1`` of its requests (others may run elsewhere).

A tenant flooding past its limit therefore gets at most the room Redis last
reported started ahead of its refusals, and then none.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from serve_app.admission.seam import Decision
from serve_app.identity.keys import KeyRecord

# Keys whose room one process remembers (least recently admitted go first).
MAX_KEYS = 10_000


@dataclass
class _Room:
    requests: float  # requests/min left (inf: unlimited)
    tokens: float  # tokens/min left
    daily: float  # token budgets left
    monthly: float
    running: int = 0  # this process' requests of the key admitted and not settled


class OverlapGuard:
    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._rooms: OrderedDict[str, _Room] = OrderedDict()

    def try_spend(self, key: KeyRecord, tokens: int) -> bool:
        """Whether a request of ``key`` reserving ``tokens`` may start before its
        admission; if so, the room it assumes is spent."""
        room = self._rooms.get(key.id)
        if room is None:
            return False
        if key.max_concurrent and room.running + 1 >= key.max_concurrent:
            return False
        if room.requests < 1 or min(room.tokens, room.daily, room.monthly) < tokens:
            return False
        room.requests -= 1
        room.tokens -= tokens
        room.daily -= tokens
        room.monthly -= tokens
        return True

    def admitted(self, key: KeyRecord, decision: Decision) -> None:
        """Redis admitted a request of ``key``: its room is what Redis reports now."""
        used = decision.budget_used()
        running = self._rooms.pop(key.id).running if key.id in self._rooms else 0
        self._rooms[key.id] = _Room(
            requests=_left(key.requests_per_minute, decision.requests_remaining),
            tokens=_left(key.tokens_per_minute, decision.tokens_remaining),
            daily=_left(key.daily_token_budget, key.daily_token_budget - used.get("daily", 0)),
            monthly=_left(key.monthly_token_budget, key.monthly_token_budget - used.get("monthly", 0)),
            running=running + 1,
        )
        while len(self._rooms) > self.max_keys:
            self._rooms.popitem(last=False)

    def refused(self, key: KeyRecord) -> None:
        """Redis refused ``key``, or could not be asked: no guess until it admits
        again (the entry stays, counting the key's requests still running here)."""
        room = self._rooms.get(key.id)
        if room is not None:
            room.requests = 0

    def ended(self, key_id: str) -> None:
        """A request ``admitted`` counted has been settled."""
        room = self._rooms.get(key_id)
        if room is not None and room.running > 0:
            room.running -= 1


def _left(limit: int, remaining: int) -> float:
    """Room under a limit (0 = unlimited) as Redis reported it."""
    return math.inf if not limit else max(remaining, 0)
