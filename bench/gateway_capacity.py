"""Gateway capacity: what the ingress path can relay when the engine costs nothing.

The model's replica is the real one (replicas/vllm_replica.py: validation, the
fields check, coalescing, usage) with an engine that answers N tokens as fast as it
can in the engine seam (``engine: replicas.instant_engine:start_instant``), so every
figure is the gateway's own: the proxy, the ingress (auth, admission and settlement
in Redis, telemetry, the relay), one hop and the replica around the engine. For each target (a set of
Ray Serve environment variables) the script starts Ray and Serve in a child
process, drives concurrent streaming chat requests for a fixed time at each
concurrency, and reads the CPU time of each process group meanwhile. Targets run
one after the other, never side by side. Prints one table: requests/s, streamed
tokens/s, TTFT p50/p99 and end-to-end p99 as the client saw them, and the
CPU-µs per request and per streamed token of the proxy and the ingress (the
number a platform team sizes ingress CPUs by).

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/gateway_capacity.py \
        [--tokens 64] [--concurrency 1 32] [--duration 15] [--targets shipped ray-proxy]

Targets ``traced-unsampled`` and ``traced-all`` are ``shipped`` with traces sent
to an OTLP sink (telemetry.tracing), nothing resp. every request sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Each target is the environment Ray Serve starts with. "shipped": what the
# Makefile exports (HAProxy ingress, throughput mode); "ray-proxy": the same with
# Ray's Python proxy instead of HAProxy (the default before).
from serve_env import MAKEFILE_ENV, RAY_PROXY_ENV  # noqa: E402

TARGETS = {
    "shipped": MAKEFILE_ENV,
    "ray-proxy": RAY_PROXY_ENV,
    "traced-unsampled": MAKEFILE_ENV,
    "traced-all": MAKEFILE_ENV,
}
# Traces (serve_app/tracing.py) to an OTLP sink in this process: the sample ratio per
# target (None: telemetry.tracing unset, as shipped). "traced-unsampled": an endpoint
# set and nothing sampled (every request still carries an unsampled span context).
TRACE_RATIO = {"traced-unsampled": 0.0, "traced-all": 1.0}
MODEL = "fake"
INSTANT_ENGINE = "replicas.instant_engine:start_instant"
APP = "llm"
# Which processes a CPU figure belongs to, by what their command line holds.
GROUPS = {
    "proxy": ("ProxyActor", "haproxy"),
    "ingress": (f"ServeReplica:{APP}:Ingress",),
    "engine": (f"ServeReplica:{APP}:model-{MODEL}",),
}


# -- one target (child process) ---------------------------------------------------------


def cpu_seconds() -> dict[str, float]:
    import psutil

    totals = dict.fromkeys(GROUPS, 0.0)
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        for group, marks in GROUPS.items():
            if any(mark in cmdline for mark in marks) and proc.info["cpu_times"] is not None:
                totals[group] += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return totals


async def drive(url: str, secret: str, tokens: int, concurrency: int, duration_s: float) -> dict:
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    ttfts, latencies, failures = [], [], 0
    stop_at = time.monotonic() + duration_s

    async def client(http: httpx.AsyncClient):
        nonlocal failures
        while time.monotonic() < stop_at:
            started = time.monotonic()
            first, tail = None, b""
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for data in response.aiter_raw():
                    if first is None:
                        first = time.monotonic()
                    tail = (tail + data)[-32:]
            if response.status_code != 200 or not tail.endswith(b"data: [DONE]\n\n"):
                failures += 1
                continue
            ttfts.append(first - started)
            latencies.append(time.monotonic() - started)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        before, started = cpu_seconds(), time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed, after = time.monotonic() - started, cpu_seconds()
    done = len(latencies)
    cpu = {group: after[group] - before[group] for group in GROUPS}
    quantile = lambda values, q: statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")  # noqa: E731
    return {
        "requests": done,
        "failures": failures,
        "requests_s": done / elapsed,
        "tokens_s": done * tokens / elapsed,
        "ttft_p50_ms": quantile(ttfts, 50),
        "ttft_p99_ms": quantile(ttfts, 99),
        "e2e_p99_ms": quantile(latencies, 99),
        **{f"{group}_us_per_request": cpu[group] / max(done, 1) * 1e6 for group in GROUPS},
        **{f"{group}_us_per_token": cpu[group] / max(done * tokens, 1) * 1e6 for group in GROUPS},
    }


def otlp_sink() -> str:
    """An OTLP/HTTP endpoint that takes every export and keeps nothing (a collector's
    cost is not the gateway's); its URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def run_target(args) -> None:
    """Child process: Ray and Serve with this process's environment, the loads, JSON on stdout."""
    import ray
    from ray import serve
    from serving_overhead import bench_api_key, free_port

    from contract.model_config import ModelConfig
    from serve_app.app import model_deployment
    from serve_app.http.ingress import Ingress
    from serve_app.settings import AppSettings, TracingConfig

    ratio = TRACE_RATIO.get(args.run_target)
    tracing = TracingConfig(endpoint=otlp_sink() if ratio is not None else None, sample_ratio=ratio or 0.0)
    model = ModelConfig(
        name=MODEL,
        queue_timeout_s=60,
        engine=INSTANT_ENGINE,
        cpus_per_replica=0.25,
        stream_batch_interval_ms=args.batch_interval_ms,
        deployment={"max_ongoing_requests": 1024, "max_queued_requests": 1024},
    )
    settings = AppSettings(models=[model], redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ingress_actor = {"num_cpus": 0.25, "runtime_env": {"env_vars": tracing.env("llm-gateway")}}
    app = Ingress.options(num_replicas=1, max_ongoing_requests=1024, ray_actor_options=ingress_actor).bind(
        settings, {MODEL: model_deployment(model, tracing.env(f"llm-model-{MODEL}"))}
    )
    port = free_port()
    ray.init(log_to_driver=False, logging_level="WARNING", include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=APP, route_prefix="/")
        url, secret = f"http://127.0.0.1:{port}", bench_api_key()
        asyncio.run(drive(url, secret, args.tokens, 4, 3.0))  # warm-up: connections, caches, JIT-free paths
        results = {str(c): asyncio.run(drive(url, secret, args.tokens, c, args.duration)) for c in args.concurrency}
        if args.profile:
            from hop_profile import profiled, report

            with profiled(Path(args.profile) / args.run_target) as hops:
                load = asyncio.run(drive(url, secret, args.tokens, max(args.concurrency), args.duration))
            results["profile"] = report(hops, load["requests"], load["requests"] * args.tokens)
        print("RESULT " + json.dumps(results), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


# -- the table ------------------------------------------------------------------------------------


COLUMNS = [
    ("requests_s", "req/s", "{:.0f}"),
    ("tokens_s", "tok/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("e2e_p99_ms", "e2e p99 ms", "{:.0f}"),
    ("proxy_us_per_request", "proxy µs/req", "{:.0f}"),
    ("ingress_us_per_request", "ingress µs/req", "{:.0f}"),
    ("proxy_us_per_token", "proxy µs/tok", "{:.1f}"),
    ("ingress_us_per_token", "ingress µs/tok", "{:.1f}"),
    ("engine_us_per_token", "replica µs/tok (no engine)", "{:.1f}"),
]


def table(results: dict[str, dict], concurrency: list[int]) -> str:
    lines = [
        "| target | c | " + " | ".join(title for _, title, _ in COLUMNS) + " | failures |",
        "|---|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for target, by_c in results.items():
        for c in concurrency:
            row = by_c[str(c)]
            cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
            lines.append(f"| {target} | {c} | " + " | ".join(cells) + f" | {row['failures']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="streamed tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load per concurrency")
    parser.add_argument(
        "--batch-interval-ms",
        type=float,
        default=50.0,
        help="the replica's stream_batch_interval_ms (configs/local.yaml: 50)",
    )
    parser.add_argument("--targets", nargs="+", default=["shipped", "ray-proxy"], choices=list(TARGETS))
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="one more load at the highest concurrency under py-spy "
        "(bench/hop_profile.py): CPU per request/token per process, top functions",
    )
    parser.add_argument("--run-target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_target:
        run_target(args)
        return 0
    results = {}
    for target in args.targets:
        child = [
            sys.executable,
            __file__,
            "--run-target",
            target,
            "--tokens",
            str(args.tokens),
            "--duration",
            str(args.duration),
            "--batch-interval-ms",
            str(args.batch_interval_ms),
            "--concurrency",
            *map(str, args.concurrency),
        ] + (["--profile", args.profile] if args.profile else [])
        done = subprocess.run(child, env={**os.environ, **TARGETS[target]}, capture_output=True, text=True, cwd=REPO)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return 1
        results[target] = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"\nGateway capacity: no engine (replicas/instant_engine.py), {args.tokens} tokens/request, "
        f"{args.duration:g} s per concurrency\n"
    )
    print(table(results, args.concurrency))
    for target, by_c in results.items():
        if "profile" in by_c:
            print(f"\n## {target}: CPU by process at c={max(args.concurrency)} (py-spy, {args.profile}/{target})\n")
            print(by_c["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
