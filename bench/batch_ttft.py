"""Interactive TTFT while a batch runs, side by side with the same load sent as clients.

The demo chat model on one replica (vLLM's priority scheduling on), behind this
stack as ``make run`` starts it (Makefile env), one stack for the whole run. A
light interactive client streams ``--interactive`` requests at a time for
``--seconds`` in each of three phases:

- ``idle``: nothing else runs;
- ``batch``: a Batch API job of ``--batch-requests`` chat requests runs
  (``client.batches.create``): background requests, ``batch.concurrency`` at a
  time, sent only while no interactive request waits, after every tier in vLLM's
  queue (serve_app/stored/batch_runner.py);
- ``as clients``: the same requests sent by another key as ordinary requests,
  ``batch.concurrency`` at a time (what a script looping over the file would do).

Prints the interactive TTFT p50/p99 per phase (and as a multiple of idle), the
interactive output tok/s, and the background work's output tok/s in the phase
(batch: from its request counts and usage; clients: their streams).

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/batch_ttft.py [--seconds 30] [--interactive 2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fair_share import Tally, closed_loop, pct  # noqa: E402
from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import bench_api_key, serve_stack  # noqa: E402

MODEL = "tiny-llama"


def stack_config(files_dir: str) -> dict:
    serve_config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    app = serve_config["applications"][0]["args"]
    [chat] = [model for model in app["models"] if model["name"] == MODEL]
    chat["deployment"] = {**chat.get("deployment", {}), "num_replicas": 1}
    chat["engine_kwargs"] = {**chat.get("engine_kwargs", {}), "scheduling_policy": "priority"}
    chat.pop("direct_route", None)  # interactive and batch requests both through the ingress, whose gate ranks them
    app["models"] = [chat]
    app["batch"] = {"files_dir": files_dir, "poll_s": 0.2}
    return serve_config


def batch_lines(count: int, output_len: int) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"b-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Summarise item {i}."}],
                    "max_tokens": output_len,
                    "min_tokens": output_len,
                    "ignore_eos": True,
                },
            }
        )
        + "\n"
        for i in range(count)
    ).encode()


async def with_batch(interactive, batch_client, args) -> dict:
    file = await batch_client.files.create(
        file=("jobs.jsonl", io.BytesIO(batch_lines(args.batch_requests, args.output_len))), purpose="batch"
    )
    batch = await batch_client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while (await batch_client.batches.retrieve(batch.id)).request_counts.completed < 2:
        await asyncio.sleep(0.2)  # running
    before = await batch_client.batches.retrieve(batch.id)
    tally, started = Tally(), time.monotonic()
    await closed_loop(interactive, tally, args.interactive, args.seconds, args.output_len)
    took = time.monotonic() - started
    after = await batch_client.batches.retrieve(batch.id)
    await batch_client.batches.cancel(batch.id)
    background = (after.usage.output_tokens - before.usage.output_tokens) if after.usage else 0
    return {
        "tally": tally,
        "took": took,
        "background_tokens": background,
        "background_done": after.request_counts.completed - before.request_counts.completed,
    }


async def as_clients(interactive, other, args) -> dict:
    background = Tally()
    tally, started = Tally(), time.monotonic()
    await asyncio.gather(
        closed_loop(interactive, tally, args.interactive, args.seconds, args.output_len),
        closed_loop(other, background, args.concurrency, args.seconds, args.output_len),
    )
    return {
        "tally": tally,
        "took": time.monotonic() - started,
        "background_tokens": background.tokens,
        "background_done": len(background.ttft),
    }


async def run(url: str, keys: dict[str, str], args) -> dict:
    import openai

    clients = {
        name: openai.AsyncOpenAI(base_url=url + "/v1", api_key=secret, max_retries=0, timeout=300)
        for name, secret in keys.items()
    }
    idle, started = Tally(), time.monotonic()
    await closed_loop(clients["interactive"], idle, args.interactive, args.seconds, args.output_len)
    rows = {"idle": {"tally": idle, "took": time.monotonic() - started, "background_tokens": 0, "background_done": 0}}
    rows["batch"] = await with_batch(clients["interactive"], clients["batch"], args)
    await asyncio.sleep(3)  # the cancelled batch's running requests end
    rows["as clients"] = await as_clients(clients["interactive"], clients["batch"], args)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--interactive", type=int, default=2, help="interactive streams at a time")
    parser.add_argument("--batch-requests", type=int, default=2000, help="more than run in a phase")
    parser.add_argument("--concurrency", type=int, default=4, help="batch.concurrency (the default)")
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    os.environ["OPENAI_API_KEY"] = bench_api_key()  # the stack's readiness check sends a request with it
    keys = {"interactive": bench_api_key(), "batch": bench_api_key()}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        log = Path(tmp) / "stack.log"
        try:
            with serve_stack(stack_config(tmp + "/files"), MODEL, log, MAKEFILE_ENV) as running:
                url = running.url
                rows = asyncio.run(run(url, keys, args))
        except Exception:
            print(
                "failed; the stack's log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""), file=sys.stderr
            )
            raise

    print(
        f"\ndemo model, 1 replica, priority scheduling; interactive: {args.interactive} streams at a time; "
        f"background: {args.concurrency} at a time; {args.output_len} output tokens each; "
        f"{args.seconds:g} s per phase\n"
    )
    columns = list(rows)
    print(f"{'metric':<34}" + "".join(f"{name:>14}" for name in columns))

    def line(label, value):
        print(f"{label:<34}" + "".join(f"{value(rows[name]):>14}" for name in columns))

    idle_p50 = pct(rows["idle"]["tally"].ttft, 50)
    line("interactive TTFT p50 ms", lambda r: f"{pct(r['tally'].ttft, 50) * 1000:.1f}")
    line("interactive TTFT p50 / idle", lambda r: f"{pct(r['tally'].ttft, 50) / idle_p50:.2f}x")
    line("interactive TTFT p99 ms", lambda r: f"{pct(r['tally'].ttft, 99) * 1000:.1f}")
    line("interactive output tok/s", lambda r: f"{r['tally'].tokens / r['took']:.1f}")
    line("background output tok/s", lambda r: f"{r['background_tokens'] / r['took']:.1f}")
    line("background requests done", lambda r: str(r["background_done"]))
    line("interactive errors", lambda r: str(r["tally"].errors))


if __name__ == "__main__":
    main()
