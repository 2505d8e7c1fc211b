"""Pure logic: how a model's autoscaling settings become Ray Serve's config,
and how the policy reads Serve's AutoscalingContext (built here as Serve's
controller builds it, with replica metrics as the replicas report them)."""

import pytest
from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscale.policy import ScalingConfig
from autoscale.serve_policy import LLMAutoscalingPolicy, load_from
from contract.autoscaling import ENGINE_WAITING, KV_CACHE_USAGE, AutoscalingSettings
from contract.model_config import ModelConfig


def context(settings, *, target, running, ongoing, waiting=(), kv=(), now=1000.0, state=None):
    serve_config = AutoscalingConfig(**settings.serve_autoscaling_config())
    replicas = [f"r{i}" for i in range(running)]
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="model-x",
        app_name="llm",
        current_num_replicas=running,
        target_num_replicas=target,
        running_replicas=replicas,
        total_num_requests=ongoing,
        total_queued_requests=0,
        aggregated_metrics={
            ENGINE_WAITING: dict(zip(replicas, waiting)),
            KV_CACHE_USAGE: dict(zip(replicas, kv)),
        },
        raw_metrics={},
        capacity_adjusted_min_replicas=settings.min_replicas,
        capacity_adjusted_max_replicas=settings.max_replicas,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=serve_config,
    )


def test_settings_become_a_valid_serve_autoscaling_config_with_our_policy():
    settings = AutoscalingSettings(min_replicas=0, max_replicas=3, initial_replicas=1)
    serve_config = AutoscalingConfig(**settings.serve_autoscaling_config())
    assert (serve_config.min_replicas, serve_config.max_replicas, serve_config.initial_replicas) == (0, 3, 1)
    assert serve_config.policy.policy_function == "autoscale.serve_policy:LLMAutoscalingPolicy"
    # The policy owns the delays; Serve's would stack on top of them.
    assert serve_config.upscale_delay_s == 0 and serve_config.downscale_delay_s == 0
    assert serve_config.policy.policy_kwargs["downscale_delay_s"] == settings.downscale_delay_s
    assert settings.scales_to_zero


def test_model_with_autoscaling_gets_it_in_its_deployment_options():
    model = ModelConfig(name="m", autoscaling={"max_replicas": 2})
    options = model.serve_options()
    assert options["autoscaling_config"]["max_replicas"] == 2
    assert "num_replicas" not in options
    assert options["graceful_shutdown_timeout_s"] >= 300  # streams drain before a replica stops


@pytest.mark.parametrize(
    "bad",
    [
        {"min_replicas": 3, "max_replicas": 2},
        {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5},
        {"kv_cache_low": 0.9, "kv_cache_high": 0.8},
        {"target_ongoing_requests": 0},
    ],
)
def test_inconsistent_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        AutoscalingSettings(**bad)


def test_autoscaling_and_a_fixed_replica_count_are_exclusive():
    with pytest.raises(ValidationError, match="either"):
        ModelConfig(name="m", autoscaling={}, deployment={"num_replicas": 2})


def test_load_sums_queues_and_averages_kv_cache_over_replicas():
    settings = AutoscalingSettings()
    load = load_from(context(settings, target=2, running=2, ongoing=9, waiting=(3, 1), kv=(0.9, 0.5)))
    assert (load.ongoing_requests, load.waiting_requests, load.kv_cache_usage) == (9, 4, pytest.approx(0.7))
    # Replicas that have not reported yet: no custom metrics, only Serve's count.
    assert load_from(context(settings, target=1, running=1, ongoing=2)).kv_cache_usage == 0


def test_policy_waits_out_its_delay_through_serve_state_then_scales():
    settings = AutoscalingSettings(max_replicas=3, target_ongoing_requests=2, upscale_delay_s=10)
    policy = LLMAutoscalingPolicy(**settings.policy_kwargs())
    replicas, state = policy(context(settings, target=1, running=1, ongoing=6, now=100))
    assert replicas == 1 and state["llm_direction"] == 1
    replicas, state = policy(context(settings, target=1, running=1, ongoing=6, now=105, state=state))
    assert replicas == 1
    replicas, state = policy(context(settings, target=1, running=1, ongoing=6, now=110, state=state))
    assert replicas == 3  # 6 ongoing / 2 per replica, within max


def test_policy_counts_starting_replicas_as_decided():
    # Target 2, one still starting: the load on the one running must not ask again.
    settings = AutoscalingSettings(max_replicas=4, target_ongoing_requests=4, upscale_delay_s=0)
    policy = LLMAutoscalingPolicy(**settings.policy_kwargs())
    replicas, _ = policy(context(settings, target=2, running=1, ongoing=8))
    assert replicas == 2


def test_engine_queue_reported_by_replicas_scales_up_below_the_request_target():
    settings = AutoscalingSettings(max_replicas=4, target_ongoing_requests=16, upscale_delay_s=0)
    policy = LLMAutoscalingPolicy(**settings.policy_kwargs())
    replicas, _ = policy(context(settings, target=1, running=1, ongoing=10, waiting=(12,), kv=(0.6,)))
    assert replicas == 2


def test_a_starting_replica_is_never_abandoned():
    # Cold start triggered by a request that then gave up: nothing is ongoing,
    # but the replica keeps starting so the client's retry finds it.
    settings = AutoscalingSettings(min_replicas=0, max_replicas=1, downscale_delay_s=0)
    policy = LLMAutoscalingPolicy(**settings.policy_kwargs())
    assert policy(context(settings, target=1, running=0, ongoing=0))[0] == 1
    assert policy(context(settings, target=1, running=1, ongoing=0))[0] == 0


def test_the_policys_defaults_are_the_settings_defaults():
    settings = AutoscalingSettings()
    for name, value in vars(ScalingConfig()).items():
        assert getattr(settings, name) == value, name
