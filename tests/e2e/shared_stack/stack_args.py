"""The application the shared stack runs: configs/local.yaml's models as shipped
(direct routes on: /v1 chat, completions and embeddings in one hop to each model's
replica), the demo cross-encoder beside them, an admin token and traces to a test-run
OTLP receiver, sampled only where a client asks. ``SHAPE`` is every way it differs
from the shipped args (tests/unit/test_stack_shapes.py holds it to that)."""

from __future__ import annotations

from stack import local_app_args

from shared_stack.stack_models import RERANKER

SHAPE = {
    "redis_url": "the package's Redis Cluster",
    "admin_token": "an admin token of this run",
    "telemetry": "traces to the package's OTLP receiver, sampled where a client asks",
    "models.minilm-reranker": "the demo cross-encoder: /score and /rerank's pair path",
    "auth": "admin failures counted under a bound the fuzz never reaches",
}


def app_args(redis_url: str, admin_token: str, traces_endpoint: str) -> dict:
    args = {**local_app_args(), "redis_url": redis_url, "admin_token": admin_token}
    # Traces on, sampled only where a client asks (its traceparent's sampled flag):
    # the other modules' requests take the unsampled path, as most would in production.
    args["telemetry"] = {**args.get("telemetry", {}), "tracing": {"endpoint": traces_endpoint, "sample_ratio": 0.0}}
    args["models"].append(RERANKER)
    # This stack's modules (the fuzz of every route, the security probes) send hundreds of
    # wrong admin credentials from one client: each is counted, as a real one would be,
    # under a bound they never reach. The bound itself: tests/integration/test_quota_hardening.py.
    args["auth"] = {**args.get("auth", {}), "admin_failures_per_minute": 100_000}
    return args
