"""Redis bytes against requests served, with the record sink and without.

Runs the real admission and settlement scripts (``Gatekeeper``: admit, settle) against a
private redis-server (started here) in rounds, and after each round prints what
Redis holds (``MEMORY USAGE`` of every key) and, with the sink, the sink's bytes per
request. Without a sink a final record stays in Redis for ``quota.request_retention_s``
(7 days), so Redis grows with every request; with one (``records.sink_dir``) it stays
there ``records.recent_s``, and Redis holds the requests of that window only. The
window is shortened here (``--recent-s``, default 5 s) so the run shows the flat line
in seconds; at the default hour, Redis holds an hour of traffic.

    .venv/bin/python bench/records_footprint.py [--rounds 4] [--requests 2000] [--recent-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_footprint import used  # noqa: E402  (bench/, beside this file)
from redis_server import running_redis  # noqa: E402

from serve_app.http.services import build_quota_services  # noqa: E402
from serve_app.identity.keys import KeyStore  # noqa: E402
from serve_app.redis_store import redis_client, redis_names  # noqa: E402
from serve_app.settings import AppSettings  # noqa: E402
from serve_app.telemetry import Telemetry  # noqa: E402


def sink_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*.jsonl"))


async def run(url: str, sink_dir: Path | None, rounds: int, per_round: int, recent_s: int) -> list[tuple]:
    client = redis_client.connect(url)
    await client.flushdb()
    records = {"sink_dir": str(sink_dir), "recent_s": recent_s} if sink_dir else {"sink_dir": None}
    access = build_quota_services(AppSettings(redis_url=url, records=records), Telemetry(False, False))
    if access.stores.records is not None:
        access.stores.records.start()
    key, _ = await KeyStore(client).create("bench-records")
    rows, served = [], 0
    for _ in range(rounds):
        started = time.monotonic()
        for i in range(per_round):
            ticket = await access.gate.admit(key, "tiny-llama", 300, http_request_id=f"{served + i:08d}-0000-4000-8000")
            access.gate.settle(ticket, "completed")
        served += per_round
        while access.gate._background:  # settlements off the request path
            await asyncio.sleep(0.01)
        while access.stores.records is not None and await client.xlen(redis_names.RECORD_OUTBOX):
            await asyncio.sleep(0.05)
        took = time.monotonic() - started
        await asyncio.sleep(max(0.0, recent_s + 1 - took) if sink_dir else 0)  # the window passes
        rows.append((served, await used(client), sink_bytes(sink_dir) if sink_dir else 0))
    await access.redis.aclose()
    await client.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--recent-s", type=int, default=5)
    args = parser.parse_args()
    with running_redis() as server, tempfile.TemporaryDirectory() as folder:
        without = asyncio.run(run(server.url, None, args.rounds, args.requests, args.recent_s))
        with_sink = asyncio.run(run(server.url, Path(folder), args.rounds, args.requests, args.recent_s))
    print(
        f"{'requests served':>16} | {'Redis bytes, no sink':>21} | {'Redis bytes, sink':>18} | "
        f"{'sink bytes':>11} | {'sink bytes/request':>18}"
    )
    print("-" * 97)
    for (served, plain, _), (_, shipped, sink) in zip(without, with_sink):
        print(f"{served:>16,} | {plain:>21,} | {shipped:>18,} | {sink:>11,} | {sink / served:>18.0f}")


if __name__ == "__main__":
    main()
