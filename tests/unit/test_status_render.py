"""`llmctl status`'s table (pure rendering; the real report: tests/e2e/local_stack/test_1_ready_e2e.py)."""

from serve_app.ops.status import render


def test_the_table_names_replicas_engine_load_and_redis():
    serve_part = {
        "application": "RUNNING",
        "deployments": {
            "model-tiny-llama": {
                "status": "UPSCALING",
                "target": 2,
                "replicas": {"RUNNING": 1, "STARTING": 1},
                "engine": {
                    "running": 3,
                    "waiting": 5,
                    "kv_cache_usage": 0.42,
                    "prefix_cache_queries": 4000,
                    "prefix_cache_hits": 3000,
                },
            },
            "model-minilm": {
                "status": "HEALTHY",
                "target": 1,
                "replicas": {"RUNNING": 1},
                "engine": {"error": "TimeoutError"},
            },
            "Ingress": {"status": "HEALTHY", "target": 1, "replicas": {"RUNNING": 1}},
        },
    }
    table = render(serve_part, {"reachable": True, "keys": 7}, "redis://r:6379/0")
    tiny = next(line for line in table.splitlines() if line.startswith("model-tiny-llama"))
    assert (
        tiny.split()[1:5] == ["UPSCALING", "1", "1", "2"]
        and "3 running, 5 waiting, KV 42%, prefix cache hits 75%" in tiny
    )
    assert "no answer (TimeoutError)" in table and "redis: reachable (redis://r:6379/0), 7 keys" in table


def test_an_unreachable_redis_and_a_missing_cluster_are_said_plainly():
    table = render(
        {"error": "no Ray cluster on this machine"},
        {"reachable": False, "error": "ConnectionError: refused"},
        "redis://r:6379/0",
    )
    assert table.splitlines() == [
        "serve: no Ray cluster on this machine",
        "redis: UNREACHABLE (redis://r:6379/0): ConnectionError: refused",
    ]


def test_the_redis_password_never_reaches_the_terminal():
    table = render(
        {"error": "no Ray cluster on this machine"},
        {"reachable": True, "keys": 1},
        "rediss+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7000",
    )
    assert "s3cret" not in table and "rediss+cluster://app:***@10.0.0.1:7000,10.0.0.2:7000" in table


def test_importing_status_imports_no_ray():
    """`llmctl status` sets the environment that joins `llmctl run`'s loopback Ray before
    it imports Ray (read at import): a module it imports at the top that imports Ray made
    every `llmctl status` against that stack hang (serve_app/ray_private.py is imported
    lazily there for this)."""
    import subprocess
    import sys

    code = "import sys, serve_app.ops.status; print('ray' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert found.stdout.strip() == "False"
