"""What a key at its limits costs everyone else when it sends the largest bodies
(docs/quotas.md, "Work before admission").

configs/local.yaml's chat model alone (one replica, its direct route: /v1 in one hop,
the gateway in the replica), started twice, side by side in one run:

- ``checked``: as shipped: a body past ``ingress.room_check_bytes`` (256 KiB) is read
  only once its key's requests/min and concurrency have room (room.lua);
- ``unchecked``: ``room_check_bytes`` past the body limit, so every body is read and
  parsed before its admission refuses it (what the gateway did before).

Per repeat: a victim key's chat latency (one at a time, ``max_tokens`` 1) with nothing
else running, then while ``--clients`` threads of a key that spent its one request a
minute each send 7.5 MiB chat bodies (every one a 429); the replica's CPU per flood
request. The table gives medians over ``--repeats``.

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/large_bodies.py [--requests 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hop_profile import cpu_seconds, processes  # noqa: E402
from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import bench_api_key, serve_stack, wait_ready  # noqa: E402

from serve_app.app import with_direct_apps  # noqa: E402

MODEL = "tiny-llama"
BODY_CHARS = 15 * 1024 * 1024 // 6  # "!? " repeated: a 7.5 MiB body, under the 8 MiB limit


def stack_config(room_check_bytes: int) -> dict:
    serve_config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = serve_config["applications"][0]["args"]
    app["models"] = [model for model in app["models"] if model["name"] == MODEL]
    app.setdefault("ingress", {})["room_check_bytes"] = room_check_bytes
    return with_direct_apps(serve_config)


def limited_key() -> str:
    """A key of one request a minute, in the stack's Redis."""
    import asyncio

    import redis.asyncio

    from serve_app.identity.keys import KeyStore
    from serve_app.limits import KeyLimits

    async def create() -> str:
        client = redis.asyncio.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        try:
            _, secret = await KeyStore(client).create(
                f"bench-at-limit-{time.monotonic_ns()}", KeyLimits(requests_per_minute=1)
            )
            return secret
        finally:
            await client.aclose()

    return asyncio.run(create())


def latencies(client: httpx.Client, requests: int) -> list[float]:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Where?"}]}
    found = []
    for _ in range(requests):
        began = time.perf_counter()
        answer = client.post("/v1/chat/completions", json=body)
        found.append((time.perf_counter() - began) * 1000)
        assert answer.status_code == 200, answer.text
    return found


def one_repeat(url: str, victim: httpx.Client, args) -> dict[str, float]:
    replica = processes({"replica": (f"ServeReplica:direct-{MODEL}:model-{MODEL}",)})["replica"]
    quiet = latencies(victim, args.requests)
    secret = limited_key()
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
    small = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=small, headers=headers, timeout=60).status_code == 200
    raw = json.dumps({**small, "messages": [{"role": "user", "content": "!? " * BODY_CHARS}]}).encode()
    stop, sent, statuses = threading.Event(), [0], set()

    def flood() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            while not stop.is_set():
                statuses.add(http.post("/v1/chat/completions", content=raw).status_code)
                sent[0] += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(args.clients)]
    cpu_before = cpu_seconds(replica)
    for thread in threads:
        thread.start()
    during = latencies(victim, args.requests)
    stop.set()
    for thread in threads:
        thread.join()
    cpu = cpu_seconds(replica) - cpu_before
    assert statuses == {429}, statuses
    return {
        "quiet p50 ms": statistics.median(quiet),
        "beside the flood p50 ms": statistics.median(during),
        "beside the flood p90 ms": statistics.quantiles(during, n=10)[-1],
        "p50 ratio (flood / quiet)": statistics.median(during) / statistics.median(quiet),
        "flood requests": sent[0],
        "replica CPU ms per flood request": cpu * 1000 / max(sent[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="victim chats per phase and repeat")
    parser.add_argument("--clients", type=int, default=4, help="threads sending large bodies")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    os.environ["OPENAI_API_KEY"] = bench_api_key()
    targets = {"checked": 256 * 1024, "unchecked": 1 << 40}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    with tempfile.TemporaryDirectory(prefix="bench-large-bodies-") as tmp:
        for name, room_check_bytes in targets.items():
            log = Path(tmp) / f"{name}.log"
            try:
                with serve_stack(stack_config(room_check_bytes), MODEL, log, MAKEFILE_ENV) as running:
                    wait_ready(running.url, None, MODEL)
                    headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
                    with httpx.Client(base_url=running.url, headers=headers, timeout=120) as victim:
                        latencies(victim, 5)  # warm
                        for repeat in range(args.repeats):
                            rows[name].append(one_repeat(running.url, victim, args))
                            print(f"{name} repeat {repeat + 1}: {rows[name][-1]}", file=sys.stderr, flush=True)
            except Exception:
                print("the stack's log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""), file=sys.stderr)
                raise

    print(
        f"\nthe demo chat model, one replica behind its direct route (/v1, one hop); a victim key's "
        f"{args.requests} chats one at a time (max_tokens 1), quiet and beside {args.clients} threads of a key "
        f"at its requests/min sending 7.5 MiB bodies; medians of {args.repeats} repeats\n"
    )
    print("| metric | " + " | ".join(targets) + " |")
    print("|---|" + "---|" * len(targets))
    for metric in rows["checked"][0]:
        cells = [f"{statistics.median(row[metric] for row in rows[name]):,.2f}" for name in targets]
        print(f"| {metric} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
