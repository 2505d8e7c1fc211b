"""Pure logic: the LLM autoscaling policy on recorded metric sequences
(one sample per 5 s tick, as a Serve controller would see them)."""

from autoscale.policy import Load, ScalingConfig, State, decide, wanted_replicas

CONFIG = ScalingConfig(
    min_replicas=1, max_replicas=4, target_ongoing_requests=16, upscale_delay_s=15, downscale_delay_s=60
)
TICK_S = 5.0


def replay(loads, start=1, config=CONFIG):
    """Feed ``loads`` tick by tick; return the replica count after each."""
    current, state, seen = start, State(), []
    for tick, load in enumerate(loads):
        decision = decide(load, current, tick * TICK_S, state, config)
        current, state = decision.replicas, decision.state
        seen.append(current)
    return seen


def test_ramp_scales_up_after_the_delay_and_not_before():
    ramp = [Load(ongoing_requests=n) for n in (4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48)] + [Load(48)] * 6
    seen = replay(ramp)
    assert seen[:5] == [1, 1, 1, 1, 1]  # 20 ongoing wants 2 from tick 4; 15 s later it gets them
    assert seen[7] == 2 and max(seen) == 3 and seen[-1] == 3
    assert all(a <= b for a, b in zip(seen, seen[1:]))  # never down on a ramp


def test_short_spike_moves_nothing_long_spike_scales_at_once_to_need():
    quiet, spike = Load(8), Load(60)
    assert replay([quiet] * 3 + [spike] * 2 + [quiet] * 10) == [1] * 15
    seen = replay([quiet] * 3 + [spike] * 6)
    assert seen[-1] == 4 and seen[5] == 1  # 60 ongoing / 16 = 4, after 15 s of it


def test_idle_returns_to_the_minimum_one_replica_per_delay():
    seen = replay([Load(0)] * 60, start=4)
    assert seen[-1] == 1
    steps = [i for i, (a, b) in enumerate(zip(seen, seen[1:])) if b < a]
    assert len(steps) == 3
    assert all((later - earlier) * TICK_S >= CONFIG.downscale_delay_s for earlier, later in zip(steps, steps[1:]))


def test_flapping_load_does_not_flap_replicas():
    flapping = [Load(40) if i % 2 else Load(4) for i in range(40)]  # every 5 s up, then down
    seen = replay(flapping, start=2)
    assert len(set(seen)) == 1


def test_full_kv_cache_scales_up_with_few_requests():
    # 6 requests with long contexts: the count says 1 replica, the cache says more.
    seen = replay([Load(ongoing_requests=6, kv_cache_usage=0.95)] * 5)
    assert seen[-1] == 2


def test_engine_queue_scales_up_even_below_the_request_target():
    wanted, reason = wanted_replicas(Load(ongoing_requests=14, waiting_requests=40), current=1, config=CONFIG)
    assert reason == "saturated" and wanted == 1 + 3  # 40 waiting / 16 per replica


def test_busy_cache_holds_replicas_that_the_request_count_would_drop():
    # Few but heavy requests: KV between low and high water marks, so hold at 3.
    seen = replay([Load(ongoing_requests=10, kv_cache_usage=0.7)] * 40, start=3)
    assert seen == [3] * 40


def test_scale_to_zero_and_cold_start():
    config = ScalingConfig(min_replicas=0, max_replicas=2, downscale_delay_s=30)
    seen = replay([Load(0)] * 10 + [Load(3)] + [Load(3)], start=1, config=config)
    assert 0 in seen[:10] and seen[-2] == 1  # the first request after idling gets a replica at once


def test_bounds_hold():
    assert wanted_replicas(Load(1000, waiting_requests=500, kv_cache_usage=1.0), current=4, config=CONFIG)[0] == 4
    assert wanted_replicas(Load(0), current=1, config=CONFIG)[0] == 1
