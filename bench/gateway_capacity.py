"""Gateway capacity: the gateway's own CPU per request and per streamed token when the
engine costs nothing.

The model's replica is the real one (replicas/vllm_replica.py: validation, the
fields check, coalescing, usage) with an engine that answers N tokens as fast as it
can in the engine seam (``engine: replicas.instant_engine:start_instant``), so every
figure is the gateway's own. Targets:

- ``one-hop``: the path ``/v1`` ships (configs/local.yaml's ``direct_route``): HAProxy
  sends the request straight to the model's replica, which runs the gateway (auth,
  admission and settlement in Redis, records, metrics, the relay) in-process beside
  the engine (serve_app/http/direct.py);
- ``shipped``: the two-hop path every other route takes, HAProxy -> ingress replica ->
  model replica; ``ray-proxy``: the same behind Ray's Python proxy;
- ``traced-unsampled``, ``traced-all``, ``one-hop-traced-unsampled``: with traces sent
  to an OTLP sink (telemetry.tracing), nothing resp. every request sampled.

For each target (a set of Ray Serve environment variables) the script starts Ray and
Serve in a child process, drives concurrent streaming chat requests for a fixed time
at each concurrency, reads the CPU time of each process group meanwhile and samples the
model replica with py-spy: the share of its samples in the engine seam
(``instant_engine.py``) is the seam's, the rest the gateway's. ``gateway µs/req`` is the
ingress' CPU plus the replica's but the seam's, per request; ``µs/tok`` the same CPU per
streamed token (one figure two ways, as a platform team sizes CPUs by either). HAProxy
(C, Ray's) is its own column. Targets run one after the other, never side by side,
``--repeats`` times interleaved; the table shows medians.

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/gateway_capacity.py \
        [--tokens 64] [--concurrency 1 32] [--duration 15] [--repeats 3] [--targets one-hop shipped]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
from starlette.requests import Request  # noqa: E402  # the floor's route: FastAPI reads its annotation by name here

TARGETS = {
    "one-hop": MAKEFILE_ENV,
    "floor": MAKEFILE_ENV,
    "one-hop-traced-unsampled": MAKEFILE_ENV,
    "shipped": MAKEFILE_ENV,
    "ray-proxy": RAY_PROXY_ENV,
    "traced-unsampled": MAKEFILE_ENV,
    "traced-all": MAKEFILE_ENV,
}
# Traces (serve_app/tracing.py) to an OTLP sink in this process: the sample ratio per
# target (None: telemetry.tracing unset, as shipped). "traced-unsampled": an endpoint
# set and nothing sampled (every request still carries an unsampled span context).
TRACE_RATIO = {"traced-unsampled": 0.0, "traced-all": 1.0, "one-hop-traced-unsampled": 0.0}
MODEL = "fake"
INSTANT_ENGINE = "replicas.instant_engine:start_instant"
APP = "llm"
# "one-hop": what `/v1` ships (configs/local.yaml's `direct_route`): HAProxy sends the
# request straight to the model's replica, which runs the gateway in-process
# (serve_app/http/direct.py) beside the engine; the ingress sees none of it. The other
# targets run the model without a direct route: HAProxy -> ingress -> model replica.
ONE_HOP_TARGETS = {"one-hop", "one-hop-traced-unsampled"}
# Which processes a CPU figure belongs to, by what their command line holds.
GROUPS = {
    "proxy": ("ProxyActor", "haproxy"),
    "ingress": (f"ServeReplica:{APP}:Ingress",),
    "engine": (f"ServeReplica:{APP}:model-{MODEL}", f"ServeReplica:direct-{MODEL}:", f"ServeReplica:{APP}:Floor"),
}
# "floor": what the one-hop path costs without the gateway: a Serve deployment on the
# same HTTP path (HAProxy, Serve's replica, FastAPI) that validates the body with vLLM's
# request model, runs the same engine seam and relays its events coalesced as the
# replica does, and nothing else: no key, no Redis, no records, no metrics. What
# one-hop costs beyond it is the gateway's own, whatever the framework costs.
FLOOR_TARGETS = {"floor"}
# The engine seam's own frames: on the one-hop path the gateway and the engine share a
# process, and py-spy's samples tell their CPU apart (what is not the seam's is the gateway's).
SEAM_FILES = ("instant_engine.py",)


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


async def drive(url: str, secret: str, tokens: int, concurrency: int, duration_s: float, read_cpu=cpu_seconds) -> dict:
    """``concurrency`` clients streaming for ``duration_s``; ``read_cpu()``: CPU seconds by
    process group, read before and after (``cpu_seconds``: this bench's groups)."""
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
        before, started = read_cpu(), time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed, after = time.monotonic() - started, read_cpu()
    done = len(latencies)
    cpu = {group: after[group] - before[group] for group in after}
    quantile = lambda values, q: statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")  # noqa: E731
    return {
        "requests": done,
        "failures": failures,
        "requests_s": done / elapsed,
        "tokens_s": done * tokens / elapsed,
        "ttft_p50_ms": quantile(ttfts, 50),
        "ttft_p99_ms": quantile(ttfts, 99),
        "e2e_p99_ms": quantile(latencies, 99),
        **{f"{group}_us_per_request": cpu[group] / max(done, 1) * 1e6 for group in cpu},
        **{f"{group}_us_per_token": cpu[group] / max(done * tokens, 1) * 1e6 for group in cpu},
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


def seam_share(profile_dir: Path) -> float:
    """The share of the model replica's py-spy samples spent in the engine seam (a stack
    through ``SEAM_FILES``), from the collapsed stacks ``hop_profile.profiled`` left."""
    seam = total = 0
    for path in profile_dir.glob("replica-*.txt"):
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                total += int(count)
                seam += int(count) if any(name in stack for name in SEAM_FILES) else 0
    return seam / total if total else 0.0


def split_load(url: str, secret: str, args, concurrency: int) -> dict:
    """One load, the model replica sampled meanwhile: its CPU split into the engine
    seam's and the gateway's (``gateway_us_*``: the ingress' and the replica's but the
    seam's: the seam's share of py-spy's samples of a second, shorter load). Its
    collapsed stacks stay in ``--profile``'s folder when given (flame graphs)."""
    import tempfile

    from hop_profile import profiled

    with tempfile.TemporaryDirectory(prefix="gateway-capacity-") as scratch:
        folder = Path(args.profile) / args.run_target / f"c{concurrency}" if args.profile else Path(scratch)
        result = asyncio.run(drive(url, secret, args.tokens, concurrency, args.duration))
        # Sampled apart: under py-spy the replica's CPU reads 25-35% higher (measured).
        with profiled(folder, {"replica": GROUPS["engine"]}):  # "engine" is hop_profile's unsampled group
            asyncio.run(drive(url, secret, args.tokens, concurrency, args.duration / 2))
        share = seam_share(folder)
    result["seam_share"] = share
    for per in ("request", "token"):
        result[f"gateway_us_per_{per}"] = result[f"ingress_us_per_{per}"] + result[f"engine_us_per_{per}"] * (1 - share)
    return result


def floor_deployment():
    """The ``floor`` target's deployment (see FLOOR_TARGETS), made in the child that runs it."""
    from fastapi import FastAPI
    from ray import serve
    from starlette.responses import StreamingResponse

    from replicas.instant_engine import start_instant
    from replicas.streaming import coalesce

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25})
    @serve.ingress(app)
    class Floor:
        async def __init__(self, config):
            self.batch_interval_s = config.stream_batch_interval_ms / 1000
            self.validator, _, self.handler = (await start_instant(config)).endpoints["chat"]
            self.streams = 0

        @app.post("/v1/chat/completions")
        async def chat(self, request: Request):
            events = await self.handler(self.validator.validate_python(await request.json()))
            return StreamingResponse(self._relayed(events), media_type="text/event-stream")

        async def _relayed(self, events):
            self.streams += 1
            try:
                async for text in coalesce(events, self.batch_interval_s, busy=lambda: self.streams > 1):
                    yield text
            finally:
                self.streams -= 1

    return Floor


def run_target(args) -> None:
    """Child process: Ray and Serve with this process's environment, the loads, JSON on stdout."""
    import ray
    from ray import serve
    from serving_overhead import bench_api_key, free_port

    from contract.model_config import ModelConfig
    from serve_app.app import build_app, build_direct_app, direct_apps, model_deployment
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
        direct_route=args.run_target in ONE_HOP_TARGETS,
        deployment={"max_ongoing_requests": 1024, "max_queued_requests": 1024},
    )
    settings = AppSettings(models=[model], redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    port = free_port()
    ray.init(log_to_driver=False, logging_level="WARNING", include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if args.run_target in FLOOR_TARGETS:
            serve.run(floor_deployment().bind(model), name=APP, route_prefix="/")
        elif model.direct_route:  # as `llmctl run` deploys configs/local.yaml: the model in its own application
            args_of_app = {
                "models": [model.model_dump(exclude_unset=True)],
                "redis_url": settings.redis_url,
                "ingress": {
                    "deployment": {
                        "num_replicas": 1,
                        "max_ongoing_requests": 1024,
                        "ray_actor_options": {"num_cpus": 0.25},
                    }
                },
                "telemetry": {"tracing": tracing.model_dump()},
            }
            for entry in direct_apps(args_of_app):
                serve.run(build_direct_app(entry["args"]), name=entry["name"], route_prefix=entry["route_prefix"])
            serve.run(build_app(args_of_app), name=APP, route_prefix="/")
        else:
            ingress_actor = {"num_cpus": 0.25, "runtime_env": {"env_vars": tracing.env("llm-gateway")}}
            app = Ingress.options(num_replicas=1, max_ongoing_requests=1024, ray_actor_options=ingress_actor).bind(
                settings, {MODEL: model_deployment(model, tracing.env(f"llm-model-{MODEL}"))}
            )
            serve.run(app, name=APP, route_prefix="/")
        url, secret = f"http://127.0.0.1:{port}", bench_api_key()
        asyncio.run(drive(url, secret, args.tokens, 4, 3.0))  # warm-up: connections, caches, JIT-free paths
        results = {str(c): split_load(url, secret, args, c) for c in args.concurrency}
        if args.profile:
            from hop_profile import GROUPS as HOPS
            from hop_profile import profiled, report

            with profiled(Path(args.profile) / args.run_target, {**HOPS, "replica": GROUPS["engine"]}) as hops:
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
    ("engine_us_per_request", "model replica µs/req", "{:.0f}"),
    ("seam_share", "of it the engine seam's", "{:.0%}"),
    ("gateway_us_per_request", "gateway µs/req", "{:.0f}"),
    ("gateway_us_per_token", "gateway µs/tok", "{:.1f}"),
]


def medians(by_repeat: list[dict]) -> dict:
    """Each figure's median over the repeats of one target (the profile: the first's)."""
    merged: dict = {key: value for key, value in by_repeat[0].items() if key == "profile"}
    for c in by_repeat[0]:
        if c != "profile":
            merged[c] = {key: statistics.median(run[c][key] for run in by_repeat) for key in by_repeat[0][c]}
    return merged


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
    parser.add_argument("--targets", nargs="+", default=["one-hop", "shipped"], choices=list(TARGETS))
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="one more load at the highest concurrency under py-spy "
        "(bench/hop_profile.py): CPU per request/token per process, top functions",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of every target, interleaved; medians shown")
    parser.add_argument("--run-target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_target:
        run_target(args)
        return 0
    runs: dict[str, list[dict]] = {target: [] for target in args.targets}
    for _, target in itertools.product(range(args.repeats), args.targets):  # repeats interleaved: drift hits all
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
        runs[target].append(json.loads(lines[-1][len("RESULT ") :]))
    results = {target: medians(by_repeat) for target, by_repeat in runs.items()}
    print(
        f"\nGateway capacity: no engine (replicas/instant_engine.py), {args.tokens} tokens/request, "
        f"{args.duration:g} s per concurrency, medians of {args.repeats}\n"
    )
    print(table(results, args.concurrency))
    if args.repeats > 1:
        print(
            "\ngateway µs/req by repeat: "
            + "; ".join(
                f"{target} c={c}: " + " / ".join(f"{run[str(c)]['gateway_us_per_request']:.0f}" for run in by_repeat)
                for target, by_repeat in runs.items()
                for c in args.concurrency
            )
        )
    for target, by_c in results.items():
        if "profile" in by_c:
            print(f"\n## {target}: CPU by process at c={max(args.concurrency)} (py-spy, {args.profile}/{target})\n")
            print(by_c["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
