"""Approximate per-replica limits for when Redis is unreachable (fail_mode: open).

Each ingress replica enforces its share of a key's limits (limit / number of
ingress replicas, read when deciding: an autoscaled ingress changes it) in memory, with the same GCRA rule as the
Redis script, so a
key cannot run unbounded while Redis is down. Budgets are not enforced here:
they need the shared counters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60.0


@dataclass
class _KeyState:
    requests_tat: float = 0.0
    tokens_tat: float = 0.0
    running: set[str] = field(default_factory=set)


class LocalLimiter:
    def __init__(self, replicas: Callable[[], int], clock=time.monotonic):
        self.replicas = replicas
        self.clock = clock
        self._keys: dict[str, _KeyState] = {}

    def _share(self, limit: int) -> int:
        return max(math.ceil(limit / max(self.replicas(), 1)), 1) if limit else 0

    def admit(self, key, request_id: str, reserve_tokens: int) -> tuple[bool, str, float]:
        """(admitted, refusal kind, retry-after seconds)."""
        state = self._keys.setdefault(key.id, _KeyState())
        now = self.clock()
        concurrent = self._share(key.max_concurrent)
        if concurrent and len(state.running) >= concurrent:
            return False, "concurrency", 1.0
        checks: list[float | None] = []  # each limit's new TAT (None: unlimited)
        for kind, limit, cost, tat in (
            ("requests", self._share(key.requests_per_minute), 1, state.requests_tat),
            ("tokens", self._share(key.tokens_per_minute), reserve_tokens, state.tokens_tat),
        ):
            if not limit:
                checks.append(None)
                continue
            new_tat = max(tat, now) + cost * WINDOW_S / limit
            if new_tat - now > WINDOW_S:
                return False, kind, new_tat - WINDOW_S - now
            checks.append(new_tat)
        if checks[0] is not None:
            state.requests_tat = checks[0]
        if checks[1] is not None:
            state.tokens_tat = checks[1]
        state.running.add(request_id)
        return True, "", 0.0

    def release(self, key_id: str, request_id: str) -> None:
        state = self._keys.get(key_id)
        if state is not None:
            state.running.discard(request_id)
