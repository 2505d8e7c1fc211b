"""Prefix-affinity routing vs Serve's default router on a shared-prefix workload, one run.

The small demo chat model on two replicas behind this stack (as ``make run`` starts
it, Makefile env), once per routing policy (``routing.policy`` in the model
config, serve_app/routing/serve_routers.py): ``power_of_two`` (Serve's default) and
``prefix_affinity`` (ours). Each policy gets a freshly started stack (empty
prefix caches), then `vllm bench serve` with vLLM's prefix-repetition dataset:
``--prefixes`` shared prefixes of ``--prefix-len`` tokens, each followed by a
different ``--suffix-len``-token question, shuffled, ``--concurrency`` at a time.

Each replica's KV cache is capped (``--kv-blocks`` blocks of 128 tokens, vLLM's
``num_gpu_blocks_override``) so that half of the prefixes (and the running
requests) fit one replica and all of them do not: the regime of a real cluster, where the prefixes in use
outnumber what one replica can keep. With the default router every replica
sees every prefix and keeps evicting; with affinity each keeps its half.

Prints one table per policy: TTFT p50/p99, TPOT p50, output tokens/s, and the
prefix-cache hit rate the engines report (prompt tokens found in the cache over
prompt tokens looked up, both replicas, this run's requests only).

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/prefix_routing.py [--prefixes 16] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import bench_api_key, serve_stack  # noqa: E402

from contract.model_config import ModelConfig, deployment_name  # noqa: E402
from replicas.sources import resolve_source  # noqa: E402

POLICIES = ["power_of_two", "prefix_affinity", "cache_affinity"]
METRICS = [
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("output_throughput", "output tok/s"),
]


def stack_config(policy: str, kv_blocks: int, source: str, direct: bool = False) -> dict:
    """The demo chat model alone on two replicas, routed by ``policy``; ``direct``: behind
    its direct route as shipped (``/v1`` in one hop, the replica chosen at the edge by
    the same router: serve_app/http/edge_router.py), else in the main application."""
    serve_config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = serve_config["applications"][0]["args"]
    [chat] = [model for model in app["models"] if model["name"] == "tiny-llama"]
    chat["cpus_per_replica"] = 0.5  # two engines and the ingress on two CPUs
    chat["deployment"] = {**chat["deployment"], "num_replicas": 2}
    chat["engine_kwargs"] = {**chat["engine_kwargs"], "num_gpu_blocks_override": kv_blocks}
    chat["routing"] = {"policy": policy}
    chat["source"] = source
    if not direct:
        chat.pop("direct_route", None)  # the ingress' request routers are what is measured
    app["models"] = [chat]
    return serve_config


def engine_loads(model: str, app_name: str = "llm") -> dict[str, dict]:
    """Each of the model's two replicas' engine_load (its prefix-cache counters among
    them), asked through Serve (engine_load names its replica); waits until both answer."""
    code = f"""
import asyncio, json, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
async def ask():
    handle = serve.get_deployment_handle({deployment_name(model)!r}, app_name={app_name!r})
    seen = {{}}
    for _ in range(600):  # until both replicas answered (the second may still be starting)
        load = await handle.engine_load.remote()
        seen[load["replica"]] = load
        if len(seen) == 2:
            break
        await asyncio.sleep(0.5)
    return seen
print(json.dumps(asyncio.run(ask())))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def prefix_cache_totals(model: str) -> tuple[int, int, int]:
    """(queries, hits, replicas seen) summed over the model's two replicas."""
    seen = engine_loads(model)
    return (
        sum(v["prefix_cache_queries"] for v in seen.values()),
        sum(v["prefix_cache_hits"] for v in seen.values()),
        len(seen),
    )


def run_load(url: str, config: ModelConfig, source: str, args, out_dir: Path, prompts: int, seed: int) -> dict:
    name = f"prefix-{time.monotonic_ns()}.json"
    cmd = [
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
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.prefix_len),
        "--prefix-repetition-suffix-len",
        str(args.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(args.prefixes),
        "--prefix-repetition-output-len",
        str(args.output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot",
        "--metric-percentiles",
        "50,99",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1536)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prompts-per-prefix", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV-cache blocks (128 tokens) per replica")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    # The small demo model: the tiny one prefills 1,000 tokens in a few ms, so what a
    # cache hit saves is lost in the rest of the path (measured: TTFT p50 -3%, p99 -37%).
    parser.add_argument("--source", default="demo:small", help="demo:small (default) or demo (the tiny model)")
    args = parser.parse_args()

    os.environ["OPENAI_API_KEY"] = bench_api_key()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        out_dir = Path(tmp)
        for policy in args.policies:
            serve_config = stack_config(policy, args.kv_blocks, args.source)
            config = ModelConfig(**serve_config["applications"][0]["args"]["models"][0])
            source = resolve_source(config)
            log = out_dir / f"{policy}.log"
            try:
                with serve_stack(serve_config, config.name, log, MAKEFILE_ENV) as running:
                    url = running.url
                    before = prefix_cache_totals(config.name)
                    result = run_load(url, config, source, args, out_dir, args.prefixes * args.prompts_per_prefix, 0)
                    after = prefix_cache_totals(config.name)
            except Exception:
                print(
                    f"{policy} failed; its log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""),
                    file=sys.stderr,
                )
                raise
            queries, hits = after[0] - before[0], after[1] - before[1]
            result["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
            result["replicas_seen"] = after[2]
            results[policy] = result
            print(
                f"{policy}: "
                + ", ".join(f"{label} {result[key]:.1f}" for key, label in METRICS)
                + f", prefix cache hits {result['prefix_cache_hit_rate']:.1%}",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"\n{args.source} model, 2 replicas ({args.kv_blocks} KV blocks of 128 tokens each); "
        f"{args.prefixes} prefixes of "
        f"{args.prefix_len} tokens x {args.prompts_per_prefix} questions of {args.suffix_len} tokens, "
        f"{args.output_len} output tokens, concurrency {args.concurrency}\n"
    )
    base = results.get("power_of_two")
    print(f"{'metric':<22}" + "".join(f"{policy:>28}" for policy in results))
    for key, label in [*METRICS, ("prefix_cache_hit_rate", "prefix cache hit rate")]:
        cells = []
        for result in results.values():
            value = result[key]
            text = f"{value:.1%}" if key == "prefix_cache_hit_rate" else f"{value:.1f}"
            ratio = f" ({value / base[key]:.2f}x)" if base and base[key] and key != "prefix_cache_hit_rate" else ""
            cells.append(f"{text + ratio:>28}")
        print(f"{label:<22}" + "".join(cells))


if __name__ == "__main__":
    main()
