"""The application this package's stack runs: the demo chat model alone, with its
direct route (its replicas answer /direct/tiny-llama themselves), behind one
autoscaled ingress replica (the target is never reached, so it stays at one),
with a 1 s concurrency lease and fail_mode open."""

from __future__ import annotations

from stack import local_app_args

MODEL = "tiny-llama"
LEASE_S = 1.0  # short: a stream outlives it, so it keeps its place only if its lease is renewed
INGRESS_MAX = 4  # the autoscaled ingress' maximum (it runs one replica)


# Every way this stack's args differ from the shipped ones (besides stack.LOCAL_SHAPE);
# tests/unit/test_stack_shapes.py holds it to that.
SHAPE = {
    "models.minilm": "the demo chat model alone",
    "redis_url": "the package's Redis, which the quota tests stall",
    "quota": "a 1 s concurrency lease, a 1 s Redis timeout, fail_mode open",
    "ingress.deployment.num_replicas": "an autoscaled ingress in its place",
    "ingress.deployment.autoscaling_config": "an autoscaled ingress that stays at one replica",
}


def app_args(redis_url: str) -> dict:
    args = local_app_args(only=[MODEL])
    args["redis_url"] = redis_url
    assert args["models"][0]["direct_route"], "the shipped demo model has its direct route"
    # redis_timeout_s: short enough for the stalled-Redis tests, long enough that a busy
    # 2-core box does not turn a slow answer into a fail-open admission mid-test.
    args["quota"] = {"concurrency_lease_s": LEASE_S, "redis_timeout_s": 1.0, "fail_mode": "open"}
    # An autoscaled ingress that stays at one replica: its fail-open share must follow
    # the running count Serve reports, not the maximum.
    deployment = args["ingress"]["deployment"]
    deployment.pop("num_replicas", None)
    deployment["autoscaling_config"] = {"min_replicas": 1, "max_replicas": INGRESS_MAX, "target_ongoing_requests": 1000}
    return args
