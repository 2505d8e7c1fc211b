"""Fair share between keys vs first come, first served, on a saturated model, one run.

The demo chat model on one replica that takes ``--ongoing`` requests at a time
(Serve's max_ongoing_requests), behind this stack as ``make run`` starts it
(Makefile env). Two keys send streams in closed loops: the heavy key with
``--heavy`` at a time, the light one with ``--light`` (8x less by default), so the
model is saturated and requests wait at the gateway. Once per mode, each on a
freshly started stack: ``fair_share.enabled: false`` (first come, first served)
and ``true`` (virtual token counters, serve_app/pipeline/fair_share.py), with one place
kept for light keys and with two (the default). Before the
contention, the light key alone on the idle model: its TTFT baseline.

With fair share the replica's 4 places are filled from the ingress, and each
place that frees goes to the waiting key with the lowest virtual token counter:
the light key's request is next whenever it waits. First come, first served
queues everything in Serve's router, in arrival order.

Prints, per mode: each key's share of the completion tokens served, its output
tokens/s, the light key's TTFT p50/p99 (and as a multiple of its idle TTFT),
the heavy key's TTFT p50, and the model's total output tokens/s (work-conserving:
fair share must not leave the engine idle).

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/fair_share.py [--seconds 30] [--heavy 16] [--light 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import bench_api_key, serve_stack  # noqa: E402

MODEL = "tiny-llama"
# Each mode's fair_share block: first come, first served; fair share with one place
# kept for light keys; as shipped (two kept, so the light key's two streams never wait).
MODES = {
    "fcfs": {"enabled": False},
    "fair_share_kept1": {"enabled": True, "light_key_places": 1},
    "fair_share": {"enabled": True},
    "no_wait": {"enabled": True},
}
# "no_wait" is the floor any order can reach here: the heavy key sends only the
# places the light key leaves (--ongoing minus --light), so no request ever waits
# for a place and the engine runs the same batch; what the light key's TTFT is
# then is the cost of sharing the engine and the box, not of the queue.


def no_wait_heavy_streams(args) -> int:
    """The heavy key's streams in "no_wait": the places the light key leaves."""
    return max(1, args.ongoing - args.light)


def stack_config(fair_share: dict, ongoing: int) -> dict:
    serve_config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = serve_config["applications"][0]["args"]
    [chat] = [model for model in app["models"] if model["name"] == MODEL]
    chat["deployment"] = {
        **chat.get("deployment", {}),
        "num_replicas": 1,
        "max_ongoing_requests": ongoing,
        "max_queued_requests": 256,
    }
    chat["fair_share"] = fair_share
    chat.pop("direct_route", None)  # the ingress' fair-share queue is what is measured
    app["models"] = [chat]
    return serve_config


class Tally:
    def __init__(self):
        self.ttft: list[float] = []
        self.tokens = 0
        self.errors = 0


async def one_stream(client, tally: Tally, output_len: int) -> None:
    started = time.monotonic()
    first = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=output_len,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": output_len, "ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic()
            if chunk.usage:
                tally.tokens += chunk.usage.completion_tokens
    except Exception:
        tally.errors += 1
        return
    if first is not None:
        tally.ttft.append(first - started)


async def closed_loop(client, tally: Tally, concurrency: int, seconds: float, output_len: int) -> None:
    deadline = time.monotonic() + seconds

    async def worker():
        while time.monotonic() < deadline:
            await one_stream(client, tally, output_len)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_mode(url: str, keys: dict[str, str], args, heavy_streams: int) -> dict:
    import openai

    clients = {
        name: openai.AsyncOpenAI(base_url=url + "/v1", api_key=secret, max_retries=0, timeout=300)
        for name, secret in keys.items()
    }
    idle = Tally()
    await closed_loop(clients["light"], idle, 1, args.idle_seconds, args.output_len)
    heavy, light = Tally(), Tally()
    started = time.monotonic()
    await asyncio.gather(
        closed_loop(clients["heavy"], heavy, heavy_streams, args.seconds, args.output_len),
        closed_loop(clients["light"], light, args.light, args.seconds, args.output_len),
    )
    took = time.monotonic() - started
    return {"idle": idle, "heavy": heavy, "light": light, "took": took}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--idle-seconds", type=float, default=8)
    parser.add_argument("--heavy", type=int, default=16, help="heavy key's streams at a time")
    parser.add_argument("--light", type=int, default=2, help="light key's streams at a time")
    parser.add_argument("--ongoing", type=int, default=4, help="requests the replica takes at a time")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()

    os.environ["OPENAI_API_KEY"] = bench_api_key()  # the stack's readiness check sends a request with it
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        for mode in args.modes:
            log = Path(tmp) / f"{mode}.log"
            keys = {"heavy": bench_api_key(), "light": bench_api_key()}
            try:
                with serve_stack(stack_config(MODES[mode], args.ongoing), MODEL, log, MAKEFILE_ENV) as running:
                    url = running.url
                    heavy_streams = no_wait_heavy_streams(args) if mode == "no_wait" else args.heavy
                    rows[mode] = asyncio.run(run_mode(url, keys, args, heavy_streams))
            except Exception:
                print(
                    f"{mode} failed; its log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""),
                    file=sys.stderr,
                )
                raise
            result = rows[mode]
            print(
                f"{mode}: heavy {result['heavy'].tokens} tokens, light {result['light'].tokens} tokens, "
                f"errors {result['heavy'].errors + result['light'].errors}",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"\ndemo model, 1 replica taking {args.ongoing} requests at a time; heavy key {args.heavy} streams at a "
        f"time (no_wait: {no_wait_heavy_streams(args)}), light key {args.light}; {args.output_len} output tokens each; "
        f"{args.seconds:g} s per mode\n"
    )
    columns = list(rows)
    print(f"{'metric':<34}" + "".join(f"{mode:>18}" for mode in columns))

    def line(label, value):
        print(f"{label:<34}" + "".join(f"{value(rows[mode]):>18}" for mode in columns))

    def share(result, key):
        total = result["heavy"].tokens + result["light"].tokens
        return f"{result[key].tokens / total:.1%}" if total else "-"

    line("light key: share of tokens", lambda r: share(r, "light"))
    line("heavy key: share of tokens", lambda r: share(r, "heavy"))
    line("light key: output tok/s", lambda r: f"{r['light'].tokens / r['took']:.1f}")
    line("heavy key: output tok/s", lambda r: f"{r['heavy'].tokens / r['took']:.1f}")
    line("model: output tok/s", lambda r: f"{(r['light'].tokens + r['heavy'].tokens) / r['took']:.1f}")
    line("light key: idle TTFT p50 ms", lambda r: f"{pct(r['idle'].ttft, 50) * 1000:.1f}")
    line("light key: TTFT p50 ms", lambda r: f"{pct(r['light'].ttft, 50) * 1000:.1f}")
    line("light key: TTFT p50 / idle", lambda r: f"{pct(r['light'].ttft, 50) / pct(r['idle'].ttft, 50):.2f}x")
    line("light key: TTFT p99 ms", lambda r: f"{pct(r['light'].ttft, 99) * 1000:.1f}")
    line("heavy key: TTFT p50 ms", lambda r: f"{pct(r['heavy'].ttft, 50) * 1000:.1f}")
    line("errors", lambda r: str(r["heavy"].errors + r["light"].errors))


if __name__ == "__main__":
    main()
