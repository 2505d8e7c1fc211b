"""How late this process' event loop runs what is due: the gatekeeper's witness for
telling a slow Redis from a slow ingress.

A Redis call times out when its reply is not handled within ``redis_timeout_s``. An
ingress whose loop runs callbacks a quarter of a timeout late (its CPU share spent: more
streams than it can relay) times out on replies Redis sent in time, and a timeout
read as "Redis unreachable" would admit on local limits (fail_mode open), past the
exact limits, on a machine whose Redis is fine. While the loop is that late, a timeout
is the ingress' own overload, and the request is shed with a 503 and retry-after
instead (gatekeeper.py). The soak's 30-minute run at 200 clients on 2 cores (load
average 16-26) admitted 1,444 requests on local limits with no Redis fault injected
(docs/operating.md, "Soak"); at half a timeout, 22 more on a replica whose loop ran
0.22 s late while a probe saw every Redis node answer in time: each call waits on the
loop more than once.

One task per process wakes every ``interval_s``; its lateness is the lag. The lag
that counts is the most seen within ``window_s``, or the current sleep's if that is
later already (a loop stalled right now has not woken the watcher yet).
"""

from __future__ import annotations

import asyncio
import collections
import time


class LoopLag:
    def __init__(
        self, interval_s: float = 0.1, window_s: float = 5.0, clock=time.monotonic, late_s: float | None = None
    ):
        """``late_s``: how late the loop runs when a Redis call that failed meanwhile is
        taken as this process' own overload (``late_during``); None: never."""
        self.interval_s, self.window_s, self.clock, self.late_s = interval_s, window_s, clock, late_s
        self._seen: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag s), lag descending
        self._sleeping_since: float | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def judging(cls, redis_timeout_s: float) -> LoopLag:
        """The watcher that judges Redis calls of ``redis_timeout_s``: late at a quarter of
        the timeout. A call waits on the loop at least twice (its write, its reply; a
        connect and a redirect more), so a call that failed below it spent half its time
        or more on the Redis path itself (the soak's probe threshold)."""
        return cls(late_s=redis_timeout_s / 4)

    def late_during(self, since: float) -> bool:
        """Whether the loop ran ``late_s`` late while a call begun at ``since`` (this
        clock) was out: a Redis failure meanwhile is this process' overload."""
        return self.late_s is not None and self.recent_s(since) >= self.late_s

    def start(self) -> None:
        """Start watching on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            self._sleeping_since = self.clock()
            await asyncio.sleep(self.interval_s)
            self.saw(self.clock() - self._sleeping_since - self.interval_s)

    def saw(self, lag_s: float) -> None:
        """One lateness, kept while it may be the window's most (a monotonic deque)."""
        now = self.clock()
        while self._seen and self._seen[-1][1] <= lag_s:
            self._seen.pop()
        self._seen.append((now, lag_s))

    def recent_s(self, since: float | None = None) -> float:
        """The most the loop was late within the window, now included; with ``since``
        (this clock), only lateness that ended after it (the span of one call)."""
        now = self.clock()
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        # The deque's lags fall from front to back: the first one seen since is the most.
        worst = next((lag for when, lag in self._seen if since is None or when >= since), 0.0)
        if self._sleeping_since is not None:
            worst = max(worst, now - self._sleeping_since - self.interval_s)
        return max(worst, 0.0)
