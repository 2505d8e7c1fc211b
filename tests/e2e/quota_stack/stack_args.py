"""The application this package's stack runs: the demo chat model behind two
ingress replicas, identity tokens of a test-run OIDC provider (a `team` claim names the user's team, its keys
trusted 4 s), traces to a test-run OTLP receiver at a sample ratio of 0.5, with a short
key cache, an admin token, 1 MiB batch files, 4 MiB of files and 3 active batches per key, 2 MiB stored in Redis per
key, and a narrow copy of it for the backpressure
tests
(one request at a time per replica, a queue of one, its own alias)."""

from __future__ import annotations

import tempfile
from copy import deepcopy

from jwks_server import AUDIENCE, ISSUER
from stack import local_app_args

MODEL = "tiny-llama"
NARROW, NARROW_ALIAS = "tiny-llama-narrow", "chat-narrow"
ADMIN = "test-admin-token-of-32-characters"
CACHE_TTL_S = 1.0
MAX_FILE_BYTES = 1 << 20  # a batch file larger is refused (413): small, so the test's upload is quick
KEY_FILE_BYTES = 4 * MAX_FILE_BYTES  # what one key's files may hold
MAX_ACTIVE_BATCHES = 3  # one key's batches not ended yet (each test here makes fewer)
STORED_BYTES = 2 * 1024 * 1024  # what one key's stored responses and batch records may hold in Redis
FILES_DIR = tempfile.mkdtemp(prefix="llm-files-quota-")  # the stack's files, where the tests can see them


JWT_REQUESTS_PER_MINUTE = 3  # each identity-token user's limit (auth.jwt.limits)
# How long a process trusts the signing keys it fetched (auth.jwt.jwks_cache_s; 300 s as
# shipped): short, so a key's removal is seen on every route within a test's wait.
JWKS_CACHE_S = 4.0
# Traces to the package's OTLP receiver, half of the requests without a client's
# traceparent sampled: the gateway's decision must hold for the engine's spans too.
TRACE_SAMPLE_RATIO = 0.5
TEAM_CLAIM = "team"  # an identity token's claim naming its user's group
# The provider's groups -> teams (only these map: a group is never a team's name by itself).
IDP_TEAM, USAGE_TEAM = "idp-team", "token-only-team"
TEAM_GROUPS = {"grp-idp": IDP_TEAM, "grp-usage": USAGE_TEAM, "grp-gone": "a-team-never-made"}


# Every way this stack's args differ from the shipped ones (besides stack.LOCAL_SHAPE);
# tests/unit/test_stack_shapes.py holds it to that. Its models keep their direct route.
SHAPE = {
    "models.minilm": "the demo chat model alone (and its narrow copy)",
    f"models.{NARROW}": "the narrow copy: one request at a time, a queue of one, its own alias, the ingress' path",
    "ingress.deployment.num_replicas": "two ingress replicas: limits held across replicas",
    "quota": "a short key cache, fail_mode open, a 1 s Redis timeout",
    "redis_url": "the package's persistent Redis",
    "admin_token": "an admin token of this run",
    "batch": "1 MiB batch files, 4 MiB per key, 3 active batches, files where tests see them",
    "store": "2 MiB stored per key",
    "auth": "the test-run OIDC provider; admin failures under a bound never reached",
    "telemetry": "traces to the package's OTLP receiver at a sample ratio of 0.5",
}


def app_args(redis_url: str, jwks_url: str | None = None, traces_endpoint: str | None = None) -> dict:
    args = local_app_args(only=[MODEL])
    args["ingress"]["deployment"]["num_replicas"] = 2
    # Redis timeout 1 s: on this loaded 2-core box a 16-client flood can delay answers
    # past 0.3 s, and a timed-out admit is decided on local limits (fail_mode open),
    # which is not what the exact-limit tests measure. Redis outages here are stops
    # (connection refused), which need no timeout.
    args["quota"] = {"key_cache_ttl_s": CACHE_TTL_S, "fail_mode": "open", "redis_timeout_s": 1.0}
    args["redis_url"] = redis_url
    args["admin_token"] = ADMIN
    args["batch"].update(
        max_file_bytes=MAX_FILE_BYTES,
        max_bytes_per_key=KEY_FILE_BYTES,
        files_dir=FILES_DIR,
        max_active_per_key=MAX_ACTIVE_BATCHES,
    )
    args["store"] = {"max_bytes_per_key": STORED_BYTES}
    # test_1_route_access_e2e.py sends every admin route each wrong credential from one client:
    # each is counted, as a real one would be, under a bound it never reaches (the bound
    # itself: tests/integration/test_quota_hardening.py).
    args["auth"] = {"admin_failures_per_minute": 100_000}
    if jwks_url is not None:  # the test's own identity provider (tests/jwks_server.py)
        args["auth"]["jwt"] = {
            "issuer": ISSUER,
            "audience": AUDIENCE,
            "jwks_url": jwks_url,
            "team_claim": TEAM_CLAIM,
            "teams": TEAM_GROUPS,
            "limits": {"requests_per_minute": JWT_REQUESTS_PER_MINUTE},
            "jwks_cache_s": JWKS_CACHE_S,
        }
    if traces_endpoint is not None:
        args["telemetry"] = {
            **args.get("telemetry", {}),
            "tracing": {"endpoint": traces_endpoint, "sample_ratio": TRACE_SAMPLE_RATIO},
        }
    narrow = deepcopy(args["models"][0])
    narrow.update(name=NARROW, aliases=[NARROW_ALIAS], cpus_per_replica=0.5)
    # The ingress' path: the backpressure tests are about the ingress replicas' queue in
    # front of a full model (each queues one; the rest are 503 model_overloaded).
    narrow.pop("direct_route")
    narrow["deployment"] = {**narrow["deployment"], "max_ongoing_requests": 1, "max_queued_requests": 1}
    args["models"].append(narrow)
    return args
