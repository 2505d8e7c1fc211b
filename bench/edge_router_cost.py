"""What the edge router costs on its own: one stack, two copies of the demo chat model
behind their direct routes, each on two replicas, side by side.

- ``routed``: ``prefix_affinity``, so its replica is chosen at the edge: HAProxy's Lua
  hands each body to the model's edge router (serve_app/http/edge_router.py), which
  asks the model's request router, then sends the request there;
- ``balanced``: ``power_of_two``, so HAProxy picks (least connections) with no call.

Everything else is the same (engines, gateway in the replicas, the one hop at ``/v1``).
Requests alternate between the two models in blocks of ``--block``, one at a time
(``max_tokens`` 1: the answer is the first token), each with a system prompt of its own
(so affinity has something to hash and no two requests share a cache entry). Per
repeat: latency p50/p90 of each model, CPU per request of the edge router's process,
HAProxy's (its Lua call is there) and each model's replicas'; and, with no load for
``--idle-s``, what the router's probes of its replicas (every 0.1 s) cost them. The
table gives medians over ``--repeats``.

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/edge_router_cost.py [--requests 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hop_profile import cpu_seconds, processes  # noqa: E402
from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import bench_api_key, serve_stack, wait_ready  # noqa: E402

from serve_app.app import with_direct_apps  # noqa: E402

ROUTED, BALANCED = "routed", "balanced"
WORDS = "policy refund parcel order shipping invoice warranty account address courier".split()


def stack_config() -> dict:
    """configs/local.yaml's chat model twice (``routed``, ``balanced``), two replicas each, alone."""
    serve_config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = serve_config["applications"][0]["args"]
    [chat] = [model for model in app["models"] if model["name"] == "tiny-llama"]
    chat["cpus_per_replica"] = 0.4  # four engines and the ingress on two CPUs
    chat["deployment"] = {**chat["deployment"], "num_replicas": 2}
    chat["direct_route"] = True
    routed, balanced = deepcopy(chat), deepcopy(chat)
    routed.update(name=ROUTED, routing={"policy": "prefix_affinity"})
    balanced.update(name=BALANCED, routing={"policy": "power_of_two"})
    app["models"] = [routed, balanced]
    return with_direct_apps(serve_config)


def groups() -> dict[str, tuple[str, ...]]:
    """The processes whose CPU is counted, by what their command line (Ray's process title) holds."""
    return {
        "edge router": (f"ServeReplica:direct-{ROUTED}:edge-router-{ROUTED}",),
        "haproxy": ("haproxy -db",),
        ROUTED: (f"ServeReplica:direct-{ROUTED}:model-{ROUTED}",),
        BALANCED: (f"ServeReplica:direct-{BALANCED}:model-{BALANCED}",),
    }


def one_repeat(client: httpx.Client, args, rng: random.Random) -> dict[str, float]:
    found = processes(groups())
    assert len(found["edge router"]) == 1 and len(found[ROUTED]) == len(found[BALANCED]) == 2, found
    latency = {ROUTED: [], BALANCED: []}
    cpu = {(model, group): 0.0 for model in latency for group in found}
    for start in range(0, args.requests, args.block):
        for model in (ROUTED, BALANCED):
            before = {group: cpu_seconds(procs) for group, procs in found.items()}
            for _ in range(min(args.block, args.requests - start)):
                system = " ".join(rng.choice(WORDS) for _ in range(args.system_words))
                body = {
                    "model": model,
                    "max_tokens": 1,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where?"}],
                }
                began = time.perf_counter()
                answer = client.post("/v1/chat/completions", json=body)
                latency[model].append((time.perf_counter() - began) * 1000)
                assert answer.status_code == 200, answer.text
            for group, procs in found.items():
                cpu[model, group] += cpu_seconds(procs) - before[group]
    before = {group: cpu_seconds(procs) for group, procs in found.items()}
    time.sleep(args.idle_s)
    idle = {group: (cpu_seconds(procs) - before[group]) / args.idle_s * 1000 for group, procs in found.items()}
    row = {}
    for model in latency:
        row[f"{model} latency p50 ms"] = statistics.median(latency[model])
        row[f"{model} latency p90 ms"] = statistics.quantiles(latency[model], n=10)[-1]
        row[f"{model}: HAProxy CPU ms/request"] = cpu[model, "haproxy"] / args.requests * 1000
        row[f"{model}: its replicas' CPU ms/request"] = cpu[model, model] / args.requests * 1000
    row["routed minus balanced latency p50 ms"] = row[f"{ROUTED} latency p50 ms"] - row[f"{BALANCED} latency p50 ms"]
    row["routed: edge router CPU ms/request"] = cpu[ROUTED, "edge router"] / args.requests * 1000
    row["idle: edge router CPU ms/s"] = idle["edge router"]
    row[f"idle: {ROUTED} replicas CPU ms/s"] = idle[ROUTED]
    row[f"idle: {BALANCED} replicas CPU ms/s"] = idle[BALANCED]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="per model and repeat")
    parser.add_argument("--block", type=int, default=20, help="requests to one model before the other's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args()

    os.environ["OPENAI_API_KEY"] = bench_api_key()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="bench-edge-router-") as tmp:
        log = Path(tmp) / "stack.log"
        try:
            with serve_stack(stack_config(), ROUTED, log, MAKEFILE_ENV) as running:
                url = running.url
                wait_ready(url, None, BALANCED)
                headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
                with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
                    args_warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.block, "idle_s": 0.1})
                    one_repeat(client, args_warm, rng)  # both replicas of each model up and warm
                    rows = []
                    for repeat in range(args.repeats):
                        rows.append(one_repeat(client, args, rng))
                        print(
                            f"repeat {repeat + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()),
                            file=sys.stderr,
                            flush=True,
                        )
        except Exception:
            print("the stack's log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""), file=sys.stderr)
            raise

    print(
        f"\nthe demo chat model twice, each on 2 replicas behind its direct route (/v1, one hop); "
        f"{args.requests} requests per model and repeat, one at a time in alternating blocks of {args.block}, "
        f"max_tokens 1, a {args.system_words}-word system prompt each; medians of {args.repeats} repeats\n"
    )
    print("| metric | median | repeats |")
    print("|---|---|---|")
    for metric in rows[0]:
        values = [row[metric] for row in rows]
        print(f"| {metric} | {statistics.median(values):,.2f} | {' / '.join(f'{v:,.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
