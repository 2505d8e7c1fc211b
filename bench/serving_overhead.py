"""Gateway overhead: bare `vllm serve`, this stack and Ray Serve LLM, same model, same load, one run.

Targets (``--targets``, all by default):

- ``vllm``: bare ``vllm serve`` with the model's engine options.
- ``stack``: this stack as ``make run`` starts it (the Makefile's Ray Serve env:
  HAProxy ingress, throughput mode; the config's direct routes with their
  applications, so a model with ``direct_route``, as shipped, takes the edge's one
  hop at ``/v1``), driven at ``/v1``.
- ``stack-ingress``: the same with no direct route: ``/v1`` through the ingress
  replica, two hops (how ``make run`` shipped before the one hop).
- ``stack-ray-proxy``: ``stack-ingress`` with Ray's Python proxy instead of HAProxy
  (``RAY_SERVE_ENABLE_HA_PROXY=0``, the default before HAProxy).
- ``stack-direct``: ``stack`` with the model's ``direct_route`` on, driven at
  ``/direct/<model>``: HAProxy straight to the model's replicas, which run the
  gateway (keys, quotas, accounting) in-process (``serve_app/http/direct.py``).
- ``rsllm``: Ray Serve LLM (``ray.serve.llm.build_openai_app``), same model and
  engine options, Ray Serve's defaults: what users would run instead of us.
- ``rsllm-fast``: Ray Serve LLM in the high-throughput mode Ray documents
  (HAProxy + throughput-optimized + ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING``).
- ``litellm``: LiteLLM's proxy in front of bare ``vllm serve``, configured the way a
  platform team runs it for per-key limits (``bench/litellm_proxy.py``: its own
  virtualenv, one worker, limits counted in the stack's Redis, a key with limits).

For each target: start it, drive it with `vllm bench serve` (random dataset,
the model's local tokenizer, ignore_eos so every request makes the same number
of tokens) at each concurrency, stop it. Targets run one after the other,
never side by side: on a 2-core box they would steal each other's CPU. With
--repeats N the whole sequence repeats and every figure is the median over
repeats. Prints one table: TTFT p50/p99, TPOT p50, output tokens/s and the CPU
each request cost outside the engine (every process of the target but vLLM's
engine core, and Redis where the target uses it) per target and each target's
ratio to bare vLLM; with repeats, each repeat's figures too,
and TTFT p50/p99 over every request of every repeat, with each of this stack's
targets against each of Ray Serve LLM's as a difference and its 95% bootstrap
interval (``bench/tail_stats.py``): a one-load p99 flips with one stall.

    python bench/serving_overhead.py [--targets vllm stack rsllm] [--concurrency 1 32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # ports: where the targets listen

from ports import free_port  # noqa: E402

from contract.model_config import ModelConfig  # noqa: E402
from replicas.sources import resolve_source  # noqa: E402
from replicas.vllm_engine import compile_env, vllm_serve_command  # noqa: E402

METRICS = [
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("output_throughput", "output tok/s"),
    ("front_cpu_ms", "CPU/req ms"),
]


# The stack's Redis (the Makefile's default): the load generator's key is made there,
# and its scheduling class is part of what a stack's figures mean.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


# The load generator's key, on every target that takes keys: limits that never bind but
# are counted (requests and tokens per minute, requests at once), as a platform team's
# key has them; LiteLLM's gets the same (bench/litellm_proxy.py).
BENCH_KEY_LIMITS = {"requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000, "max_concurrent": 10_000}


def bench_api_key() -> str:
    """A key with BENCH_KEY_LIMITS in the stack's Redis (REDIS_URL) for the load generator."""
    import asyncio

    import redis.asyncio
    import redis.exceptions

    from serve_app.identity.keys import KeyStore
    from serve_app.limits import KeyLimits

    async def create() -> str:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            return (await KeyStore(client).create(f"bench-{time.time_ns()}", KeyLimits(**BENCH_KEY_LIMITS)))[1]
        finally:
            await client.aclose()

    try:
        return asyncio.run(create())
    except redis.exceptions.ConnectionError as exc:
        # `make bench` starts it (scripts/ensure_redis.sh); a direct run needs it up.
        raise SystemExit(f"the stack's Redis is not reachable ({exc}): run `make redis` first") from None


def redis_class() -> str:
    """The scheduling class of the stack's Redis when it runs on this host, for the
    table's header: in the normal class, beside the engine on this box's two cores, about
    one admission in a hundred waited 130-220 ms for its reply (an early-started stream
    still waits for the yes), which then is the stack's c=1 TTFT p99, not its gateway
    (docs/performance-history.md, "What the c=1 tail was"); ``scripts/ensure_redis.sh`` starts it
    in the real-time class."""
    pid = redis_pid()
    if pid is None:  # not on this host (another machine's pid), or gone
        return "unknown class"
    try:
        policy = os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK  # ensure_redis.sh sets reset-on-fork
    except OSError:
        return "unknown class"
    return "real-time class" if policy in (os.SCHED_FIFO, os.SCHED_RR) else "normal class"


def redis_pid() -> int | None:
    """The stack's Redis (REDIS_URL) when it runs on this host (None otherwise): its CPU
    is a stack's (and LiteLLM's limits') cost per request, its class part of what the
    figures mean."""
    import psutil
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL)
        pid = int(client.info("server")["process_id"])
        client.close()
        return pid if psutil.pid_exists(pid) else None
    except Exception:
        return None


@dataclass
class Running:
    """A started target: where to send requests, and the processes it runs as (each
    with its descendants) for its CPU."""

    url: str
    pids: list[int] = field(default_factory=list)


def front_cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of every process under ``pids`` (each with its
    descendants) but vLLM's engine processes (what every target runs alike, left out so
    that "CPU/req" is what the target adds in front of the engine), by pid."""
    import psutil
    from hop_profile import GROUPS

    found: dict[int, float] = {}
    for pid in pids:
        try:
            top = psutil.Process(pid)
            tree = [top, *top.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                if any(mark in " ".join(proc.cmdline()) for mark in GROUPS["engine"]):
                    continue
                times = proc.cpu_times()
            except psutil.Error:
                continue
            found[proc.pid] = times.user + times.system
    return found


def wait_ready(url: str, proc: subprocess.Popen, model: str, timeout_s: float = 600) -> None:
    """Up means a real completion came back, not just /v1/models."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
            if httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not come up")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def bare_vllm(config: ModelConfig, source: str, log: Path):
    port = free_port()
    cmd = vllm_serve_command(config, source, "127.0.0.1", port)
    with log.open("w") as out:
        env = {**os.environ, **compile_env(config), **config.env}
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, cwd=REPO)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, config.name)
        yield Running(f"http://127.0.0.1:{port}", [proc.pid])
    finally:
        stop(proc)


@contextmanager
def litellm_in_front(config: ModelConfig, source: str, out_dir: Path):
    """LiteLLM's proxy (bench/litellm_proxy.py) in front of bare ``vllm serve``."""
    from litellm_proxy import litellm_command

    with bare_vllm(config, source, out_dir / "litellm-vllm.log") as engine:
        port = free_port()
        key = os.environ["OPENAI_API_KEY"]  # the load generator's
        cmd, env = litellm_command(engine.url, config.name, REDIS_URL, out_dir / "litellm", port, key, BENCH_KEY_LIMITS)
        with (out_dir / "litellm.log").open("w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, cwd=out_dir / "litellm")
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, config.name)
            yield Running(f"http://127.0.0.1:{port}", [proc.pid, *engine.pids, *filter(None, [redis_pid()])])
        finally:
            stop(proc)


from serve_env import MAKEFILE_ENV, RAY_DEFAULT_ENV, RAY_PROXY_ENV, RSLLM_FAST_ENV  # noqa: E402

TARGETS = ["vllm", "stack", "stack-ingress", "stack-direct", "stack-ray-proxy", "rsllm", "rsllm-fast", "litellm"]


def without_direct_route(serve_config: dict) -> dict:
    """``serve_config`` with every model behind the ingress."""
    serve_config = copy.deepcopy(serve_config)
    for model in serve_config["applications"][0]["args"]["models"]:
        model.pop("direct_route", None)
    return serve_config


def with_direct_route(serve_config: dict) -> dict:
    """``serve_config`` with its (first) model's direct route on, and its application."""
    from serve_app.app import direct_apps

    serve_config = copy.deepcopy(serve_config)
    main = serve_config["applications"][0]
    main["args"]["models"][0]["direct_route"] = True
    serve_config["applications"] += direct_apps(main["args"])
    return serve_config


@contextmanager
def direct_stack(serve_config: dict, config: ModelConfig, log: Path, env: dict[str, str]):
    """The stack with the model's direct route; yields the route's base URL."""
    from contract.model_config import direct_route_prefix

    with serve_stack(with_direct_route(serve_config), config.name, log, env) as running:
        direct = running.url + direct_route_prefix(config.name)
        wait_ready(direct, None, config.name)
        yield Running(direct, running.pids)


def ray_serve_llm_config(config: ModelConfig, source: str, ingress_cpus: float | None) -> dict:
    """A Serve config running Ray Serve LLM's OpenAI app on the same model with the
    same engine options, replica count and CPU share as our model deployment, and
    its ingress with our ingress' CPU share (``ingress_cpus``; Serve's default of
    one CPU would not fit beside the model on two cores). None: no ingress
    deployment (direct streaming, where the model deployment is the ingress)."""
    deployment = {
        k: v
        for k, v in config.deployment.items()
        if k in ("num_replicas", "max_ongoing_requests", "autoscaling_config")
    }
    if "autoscaling_config" not in deployment:
        deployment.setdefault("num_replicas", 1)
    # Ray Serve LLM adds the replica actor's CPUs (default 1) to the engine's bundle:
    # 0 here, so the replica with its engine reserves what ours does.
    deployment["ray_actor_options"] = {"num_cpus": 0}
    serve_config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1"},
        "applications": [
            {
                "name": "rsllm",
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_openai_app",
                "args": {
                    "llm_configs": [
                        {
                            "model_loading_config": {"model_id": config.name, "model_source": source},
                            "accelerator_config": {"kind": "cpu"},
                            "engine_kwargs": dict(config.engine_kwargs),
                            "placement_group_config": {"bundles": [{"CPU": config.cpus_per_replica}]},
                            "deployment_config": deployment,
                            "runtime_env": {"env_vars": dict(config.env)},
                        }
                    ]
                },
            }
        ],
    }
    if ingress_cpus is not None:
        app = serve_config["applications"][0]["args"]
        app["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": ingress_cpus}}
    return serve_config


@contextmanager
def serve_stack(serve_config: dict, model: str, log: Path, env: dict[str, str], with_redis: bool = True):
    """``serve run`` of ``serve_config`` (its Ray starts under it); ``with_redis``: the
    target's CPU includes Redis's (this stack's; Ray Serve LLM uses none)."""
    port = free_port()
    serve_config = {**serve_config, "http_options": {**serve_config.get("http_options", {}), "port": port}}
    config_file = log.with_suffix(".yaml")
    config_file.write_text(yaml.safe_dump(serve_config))
    serve_bin = Path(sys.executable).with_name("serve")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(serve_bin), "run", str(config_file)],
            env={**os.environ, **env},
            stdout=out,
            stderr=out,
            cwd=REPO,
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, model)
        yield Running(f"http://127.0.0.1:{port}", [proc.pid, *filter(None, [redis_pid() if with_redis else None])])
    finally:
        stop(proc)


def profile_target(running: Running, config: ModelConfig, source: str, target: str, args, out_dir: Path) -> str:
    from hop_profile import GROUPS, profiled, report

    groups = GROUPS
    if target.startswith("rsllm"):  # Ray Serve LLM's own deployments in the "rsllm" application
        groups = {
            **GROUPS,
            "ingress": ("ServeReplica:rsllm:OpenAiIngress",),
            "replica": ("ServeReplica:rsllm:LLMServer",),
        }
    if target in ("stack", "stack-direct"):  # the model's replicas answer HTTP in their own application
        groups = {**GROUPS, "replica": ("ServeReplica:llm:model-", "ServeReplica:direct-")}
    if target == "vllm":  # `vllm serve`'s API server process is what a model replica is here
        groups = {**GROUPS, "replica": ("vllm_cli serve",)}
    with profiled(args.profile / target, groups) as hops:
        result = run_load(running, config, source, max(args.concurrency), args, out_dir)
    return report(hops, result["completed"], result["total_output_tokens"])


def client_priority(wanted: str) -> list[str]:
    """What the load generator's command starts with: ``chrt -f 1`` for the real-time
    class when asked and allowed, nothing otherwise (a note on stderr).

    Why: on this 2-core box a c=1 client in the normal class beside ``make run``'s stack
    was seen waiting on the run queue for a whole stream (its ``schedstat``: 119-143 ms)
    while the answer sat in its socket (tcpdump: the replica sent every chunk on time),
    so its TTFT was the stream's length (docs/performance-history.md, "What the c=1 tail was").
    A client on another machine reads what arrives when it arrives; in the real-time
    class this one does too, for every target alike."""
    if wanted != "realtime":
        return []
    if subprocess.run(["chrt", "-f", "1", "true"], capture_output=True).returncode != 0:
        print("load generator stays in the normal class (chrt -f refused)", file=sys.stderr)
        return []
    return ["chrt", "-f", "1"]


def run_load(running: Running, config: ModelConfig, source: str, concurrency: int, args, out_dir: Path) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    url = running.url
    cmd = [
        *args.client_prefix,
        sys.executable,
        "-m",
        "replicas.vllm_cli",
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        source,
        "--served-model-name",
        config.name,
        "--tokenizer",
        source,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        str(args.range_ratio),
        "--num-prompts",
        str(max(args.num_prompts, concurrency * args.min_rounds)),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    cpu_before = front_cpu_s(running.pids)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    cpu_after = front_cpu_s(running.pids)
    result = json.loads((out_dir / name).read_text())
    # A process gone meanwhile is left out (its CPU unknown); one new counts from 0.
    spent_s = sum(after - cpu_before.get(pid, 0.0) for pid, after in cpu_after.items())
    result["front_cpu_ms"] = 1000 * spent_s / max(result["completed"], 1)
    # Each answered request's TTFT (s) for the pooled tails (a failed one's is 0);
    # not the texts and inter-token latencies.
    result["ttfts"] = [ttft for ttft, error in zip(result["ttfts"], result["errors"]) if not error]
    return {key: value for key, value in result.items() if key not in ("itls", "generated_texts", "errors")}


def print_per_repeat(results: dict[tuple[str, int], list[dict]], targets: list[str], concurrencies: list[int]) -> None:
    """Each repeat's figures side by side: the box's speed drifts between repeats
    (1.5x within one run here), so which target leads within a repeat, where all
    ran at one speed, says more than medians across repeats."""
    print("\nper repeat (r1 / r2 / ...), targets in the order they ran within each repeat\n")
    cells = {
        (t, concurrency, key): " / ".join(f"{r[key]:.2f}" for r in results[(t, concurrency)])
        for t in targets
        for concurrency in concurrencies
        for key, _ in METRICS
    }
    width = max(len(cell) for cell in [*cells.values(), *targets]) + 3  # never run into each other
    print(f"{'conc':>4}  {'metric':<14}" + "".join(f"{t:>{width}}" for t in targets))
    for concurrency in concurrencies:
        for key, label in METRICS:
            print(
                f"{concurrency:>4}  {label:<14}" + "".join(f"{cells[(t, concurrency, key)]:>{width}}" for t in targets)
            )


def print_pooled_tails(
    results: dict[tuple[str, int], list[dict]], targets: list[str], concurrencies: list[int]
) -> list[dict]:
    """TTFT p50/p99 over every request of every repeat per target, then each of
    this stack's targets against each of Ray Serve LLM's: the difference (ms,
    negative = this stack ahead) and its 95% bootstrap interval."""
    from tail_stats import bootstrap_difference, percentile_ms, verdict

    pooled = {point: [ttft for result in runs for ttft in result["ttfts"]] for point, runs in results.items()}

    print("\nTTFT over every request of every repeat (ms)\n")
    print(f"{'conc':>4}  {'target':<16}{'requests':>9}{'p50':>9}{'p99':>9}")
    for concurrency in concurrencies:
        for target in targets:
            samples = pooled[(target, concurrency)]
            print(
                f"{concurrency:>4}  {target:<16}{len(samples):>9}{percentile_ms(samples, 50):>9.2f}"
                f"{percentile_ms(samples, 99):>9.2f}"
            )
    ours = [t for t in targets if t.startswith("stack")]
    theirs = [t for t in targets if t.startswith("rsllm")]
    comparisons = []
    if ours and theirs:
        print("\nfirst - second, TTFT ms [95% bootstrap interval]; negative: the first is ahead\n")
        for concurrency in concurrencies:
            for first in ours:
                for second in theirs:
                    for q in (50, 99):
                        difference, low, high = bootstrap_difference(
                            pooled[(first, concurrency)], pooled[(second, concurrency)], q
                        )
                        comparisons.append(
                            {
                                "concurrency": concurrency,
                                "first": first,
                                "second": second,
                                "percentile": q,
                                "difference_ms": difference,
                                "low_ms": low,
                                "high_ms": high,
                            }
                        )
                        print(
                            f"{concurrency:>4}  {first} - {second} p{q}: {difference:+.2f} "
                            f"[{low:+.2f}, {high:+.2f}]  {verdict(low, high)}"
                        )
    return comparisons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.yaml")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=TARGETS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=1000,
        help="requests per point (at least): a p99 over n requests is about the n/100-th "
        "slowest, so over 128 it is the second slowest and flips with one stall of the box",
    )
    parser.add_argument(
        "--min-rounds",
        type=int,
        default=2,
        help="at least this many requests per concurrent client: more samples where the "
        "concurrency is high (a c=32 point's first round is a burst on an idle engine)",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="input and output lengths drawn from len x [1-r, 1+r] (same seed, same draws for "
        "every target): with 0, every request ends on the same step and a c=32 point is "
        "rounds of 32 arriving at once, whose split into prefill steps sets its TTFT",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--client-class",
        choices=("realtime", "normal"),
        default="realtime",
        help="the load generator's scheduling class: realtime (SCHED_FIFO 1, the default) reads "
        "answers as they arrive; normal lets a busy target's processes starve it "
        "(every run before 2026-11-28's afternoon)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument(
        "--stack-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for this stack's targets (e.g. Ray Serve knobs)",
    )
    parser.add_argument("--batch-ms", type=float, help="override stream_batch_interval_ms")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after each target's measured loads, one more at the highest concurrency under "
        "py-spy (bench/hop_profile.py): CPU per request/token per process, top functions",
    )
    args = parser.parse_args()
    missing = [name for name in ("pyarrow", "jsonref") if importlib.util.find_spec(name) is None]
    if missing and any(target.startswith("rsllm") for target in args.targets):
        # ray.serve.llm imports them in its application build, which Serve retries while
        # `serve run` waits: without them a Ray Serve LLM target would only time out.
        raise SystemExit(f"Ray Serve LLM needs {', '.join(missing)}: pip install -e '.[bench]' (`make bench` does)")
    args.client_prefix = client_priority(args.client_class)  # asked once: the header says what ran

    from serve_app.app import with_direct_apps

    serve_config = yaml.safe_load(args.config.read_text())
    # The first model only: one engine per target, the same one for every target.
    serve_config["applications"][0]["args"]["models"] = serve_config["applications"][0]["args"]["models"][:1]
    if args.batch_ms is not None:
        serve_config["applications"][0]["args"]["models"][0]["stream_batch_interval_ms"] = args.batch_ms
    stack_env = dict(item.split("=", 1) for item in args.stack_env)
    # vllm bench (and wait_ready) send it as a Bearer token; bare vLLM and Ray Serve LLM ignore it,
    # so Redis (REDIS_URL) is needed only when this stack is among the targets.
    stack_targets = {"stack", "stack-ingress", "stack-direct", "stack-ray-proxy"} & set(args.targets)
    os.environ["OPENAI_API_KEY"] = bench_api_key() if stack_targets else "unused"
    config = ModelConfig(**serve_config["applications"][0]["args"]["models"][0])
    ingress_cpus = serve_config["applications"][0]["args"]["ingress"]["deployment"]["ray_actor_options"]["num_cpus"]
    source = resolve_source(config)
    results: dict[tuple[str, int], list[dict]] = {}
    profiles: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out_dir = Path(tmp)
        starts = {
            "vllm": lambda: bare_vllm(config, source, out_dir / "vllm.log"),
            "stack": lambda: serve_stack(
                with_direct_apps(serve_config), config.name, out_dir / "stack.log", {**MAKEFILE_ENV, **stack_env}
            ),
            "stack-ingress": lambda: serve_stack(
                without_direct_route(serve_config),
                config.name,
                out_dir / "stack-ingress.log",
                {**MAKEFILE_ENV, **stack_env},
            ),
            "stack-direct": lambda: direct_stack(
                serve_config, config, out_dir / "stack-direct.log", {**MAKEFILE_ENV, **stack_env}
            ),
            "stack-ray-proxy": lambda: serve_stack(
                without_direct_route(serve_config),
                config.name,
                out_dir / "stack-ray-proxy.log",
                {**RAY_PROXY_ENV, **stack_env},
            ),
            "rsllm": lambda: serve_stack(
                ray_serve_llm_config(config, source, ingress_cpus),
                config.name,
                out_dir / "rsllm.log",
                RAY_DEFAULT_ENV,
                with_redis=False,
            ),
            "rsllm-fast": lambda: serve_stack(
                ray_serve_llm_config(config, source, None),
                config.name,
                out_dir / "rsllm-fast.log",
                {**RAY_DEFAULT_ENV, **RSLLM_FAST_ENV},
                with_redis=False,
            ),
            "litellm": lambda: litellm_in_front(config, source, out_dir),
        }
        for _ in range(args.repeats):
            for target in args.targets:
                try:
                    with starts[target]() as running:
                        run_load(running, config, source, 1, args, out_dir)  # warm-up, discarded
                        for concurrency in args.concurrency:
                            result = run_load(running, config, source, concurrency, args, out_dir)
                            results.setdefault((target, concurrency), []).append(result)
                            print(
                                f"{target} c={concurrency}: "
                                + ", ".join(f"{label} {result[key]:.2f}" for key, label in METRICS),
                                file=sys.stderr,
                                flush=True,
                            )
                        if args.profile:
                            profiles[target] = profile_target(running, config, source, target, args, out_dir)
                except Exception:
                    log = out_dir / f"{target}.log"
                    print(
                        f"target {target} failed; its log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""),
                        file=sys.stderr,
                    )
                    raise

    def median(target: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(target, concurrency)])

    spread = f" (x [{1 - args.range_ratio:g}, {1 + args.range_ratio:g}])" if args.range_ratio else ""
    beside = f"load generator in the {'realtime' if args.client_prefix else 'normal'} class"
    if stack_targets:
        beside += f", Redis in the {redis_class()}"
    print(
        f"\nmodel {config.name}; input {args.input_len} tok, output {args.output_len} tok{spread}, "
        f"max({args.num_prompts}, {args.min_rounds} x c) prompts per point, median of {args.repeats} repeat(s); "
        f"{beside}; (x) = ratio to bare vllm\n"
    )
    print(f"{'conc':>4}  {'metric':<14}" + "".join(f"{t:>22}" for t in args.targets))
    raw = []
    for concurrency in args.concurrency:
        for key, label in METRICS:
            row = {t: median(t, concurrency, key) for t in args.targets}
            raw.append({"concurrency": concurrency, "metric": key, **row})
            base = row.get("vllm")
            cells = "".join(
                f"{value:>13.2f}" + (f" ({value / base:5.2f}x)" if base else " " * 9) for value in row.values()
            )
            print(f"{concurrency:>4}  {label:<14}{cells}")
    if args.repeats > 1:
        print_per_repeat(results, args.targets, args.concurrency)
    comparisons = print_pooled_tails(results, args.targets, args.concurrency)
    if args.json:
        per_repeat = [
            {
                "target": target,
                "concurrency": concurrency,
                "repeat": index + 1,
                **{key: result[key] for key, _ in METRICS},
            }
            for (target, concurrency), runs in results.items()
            for index, result in enumerate(runs)
        ]
        args.json.write_text(
            json.dumps({"medians": raw, "repeats": per_repeat, "pooled_ttft_differences": comparisons}, indent=2)
        )
    for target, text in profiles.items():
        print(f"\n## {target}: CPU by process at c={max(args.concurrency)} (py-spy, {args.profile / target})\n\n{text}")


if __name__ == "__main__":
    main()
