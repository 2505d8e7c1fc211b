"""The event loop's lateness as the gatekeeper reads it (serve_app/admission/loop_lag.py):
the most within its window (or since a call went out), the current stall included,
then forgotten."""

import asyncio
import time

from serve_app.admission.loop_lag import LoopLag


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_most_within_the_window_counts_and_then_is_forgotten():
    clock = Clock()
    lag = LoopLag(window_s=5.0, clock=clock)
    lag.saw(0.02)
    clock.now += 1
    lag.saw(0.4)
    clock.now += 1
    lag.saw(0.05)
    assert lag.recent_s() == 0.4
    clock.now += 3.5  # 0.4 was seen 4.5 s ago
    assert lag.recent_s() == 0.4
    clock.now += 1
    assert lag.recent_s() == 0.05
    clock.now += 10
    assert lag.recent_s() == 0.0


def test_since_a_call_went_out_only_what_ended_after_it_counts():
    # A stall before a Redis call is not why the call failed; one while it was out is.
    clock = Clock()
    lag = LoopLag(window_s=5.0, clock=clock)
    lag.saw(0.4)
    clock.now += 1
    lag.saw(0.05)
    sent = clock.now + 0.5
    clock.now += 1
    assert lag.recent_s(sent) == 0.0 and lag.recent_s() == 0.4
    lag.saw(0.2)
    assert lag.recent_s(sent) == 0.2
    lag._sleeping_since = clock.now
    clock.now += 0.5  # stalled now, the watcher not woken yet
    assert abs(lag.recent_s(sent) - 0.4) < 1e-9


def test_a_stall_counts_before_the_watcher_wakes():
    clock = Clock()
    lag = LoopLag(interval_s=0.1, clock=clock)
    lag._sleeping_since = clock.now  # the watcher went to sleep
    clock.now += 0.6  # and the loop has not run it since
    assert abs(lag.recent_s() - 0.5) < 1e-9


async def test_on_a_real_loop_a_blocking_call_is_seen():
    lag = LoopLag(interval_s=0.05)
    lag.start()
    await asyncio.sleep(0.2)
    assert lag.recent_s() < 0.2
    time.sleep(0.3)  # the loop's CPU spent elsewhere
    await asyncio.sleep(0.1)
    assert lag.recent_s() >= 0.2
    lag._task.cancel()
