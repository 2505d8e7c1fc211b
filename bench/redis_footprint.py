"""Redis bytes per admitted request and per refusal, and admission round trips.

Runs the real admission scripts against a private redis-server (started here)
and prints a table: how much the stored keys (``MEMORY USAGE`` of each) grow per admitted-and-settled
request (its record for ``request_retention_s``, its x-request-id index) and
per refused request (counters only), measured over many requests.

    .venv/bin/python bench/redis_footprint.py [--requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_server import running_redis  # noqa: E402

from serve_app.admission import Admission  # noqa: E402
from serve_app.keys import KeyRecord  # noqa: E402
from serve_app.usage import new_request_id  # noqa: E402


async def measure(url: str, count: int) -> list[tuple[str, float, float]]:
    client = aioredis.Redis.from_url(url)
    admission = Admission(client, lease_s=600, retention_s=7 * 86400)
    rows = []

    async def used() -> int:
        """Bytes of every key (MEMORY USAGE): what is stored, without connection buffers."""
        total = 0
        async for name in client.scan_iter(count=1000):
            total += await client.memory_usage(name, samples=0) or 0
        return total

    # Admitted and settled, each with a 36-character x-request-id (Serve's uuid).
    key = KeyRecord(id="kbench1", name="bench", created_at=0, requests_per_minute=10**6, tokens_per_minute=10**9)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 100)  # first-use keys aside
    before = await used()
    await client.config_resetstat()
    for i in range(count):
        request_id = new_request_id(key.id)
        http_id = f"{i:08d}-0000-4000-8000-000000000000"
        await admission.admit(key, request_id, "tiny-llama", 300, http_id)
        await admission.index_http_id(http_id, request_id)
        await admission.settle(key, request_id, "completed", 20, 40, "replica-abc123", "tiny-llama")
    stats = await client.info("commandstats")
    rows.append(("admitted + settled", (await used() - before) / count,
                 stats["cmdstat_evalsha"]["calls"] / count))

    # Refused (requests/min exhausted), each with a 4 KB x-request-id.
    key = KeyRecord(id="kbench2", name="bench2", created_at=0, requests_per_minute=1)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 1)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 1)
    before = await used()
    await client.config_resetstat()
    for i in range(count):
        await admission.admit(key, new_request_id(key.id), "tiny-llama", 1, f"{i:04d}" + "x" * 4092)
    stats = await client.info("commandstats")
    rows.append(("refused (4 KB x-request-id)", (await used() - before) / count,
                 stats["cmdstat_evalsha"]["calls"] / count))
    await client.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    with running_redis() as server:
        rows = asyncio.run(measure(server.url, args.requests))
    print(f"{'request':<30} {'bytes each':>12} {'EVALSHA each':>13}")
    for name, size, calls in rows:
        print(f"{name:<30} {size:>12.1f} {calls:>13.2f}")


if __name__ == "__main__":
    main()
