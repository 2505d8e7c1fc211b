"""Redis bytes per admitted request, per refusal and per stored object.

Runs the real admission scripts and stores against a private redis-server (started
here) and prints a table: how much the stored keys (``MEMORY USAGE`` of each) grow
per admitted-and-settled request (its record for ``request_retention_s``, its
x-request-id index entries) and per refused request (counters only), measured over
many requests; then per stored object of each kind a key can keep (a file's
metadata, index entry and storage-account entry; a batch's record, index and
account entries, with and without its 100 errors; a stored response with a small
and a large conversation), with what the key's storage account counts for it.

    .venv/bin/python bench/redis_footprint.py [--requests 5000] [--objects 200]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_server import running_redis  # noqa: E402

from serve_app.accounting.usage import new_request_id  # noqa: E402
from serve_app.admission.scripts import AdmissionScripts  # noqa: E402
from serve_app.identity.keys import KeyRecord  # noqa: E402
from serve_app.stored.batches import BatchStore  # noqa: E402
from serve_app.stored.files_api import FileStore  # noqa: E402
from serve_app.stored.stored_responses import ResponseStore, stored_space  # noqa: E402


async def used(client) -> int:
    """Bytes of every key (MEMORY USAGE): what is stored, without connection buffers."""
    total = 0
    async for name in client.scan_iter(count=1000):
        total += await client.memory_usage(name, samples=0) or 0
    return total


async def measure(url: str, count: int) -> list[tuple[str, float, float]]:
    client = aioredis.Redis.from_url(url)
    admission = AdmissionScripts(client, lease_s=600, retention_s=7 * 86400)
    rows = []

    # Admitted and settled, each with a 36-character x-request-id (Serve's uuid).
    key = KeyRecord(id="kbench1", name="bench", created_at=0, requests_per_minute=10**6, tokens_per_minute=10**9)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 100)  # first-use keys aside
    before = await used(client)
    await client.config_resetstat()
    for i in range(count):
        request_id = new_request_id(key.id)
        http_id = f"{i:08d}-0000-4000-8000-000000000000"
        await admission.admit(key, request_id, "tiny-llama", 300, http_id)
        await admission.index_http_id(http_id, request_id)
        await admission.settle(key, request_id, "completed", 20, 40, "replica-abc123", "tiny-llama")
    stats = await client.info("commandstats")
    rows.append(
        ("admitted + settled", (await used(client) - before) / count, stats["cmdstat_evalsha"]["calls"] / count)
    )

    # Refused (requests/min exhausted), each with a 4 KB x-request-id.
    key = KeyRecord(id="kbench2", name="bench2", created_at=0, requests_per_minute=1)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 1)
    await admission.admit(key, new_request_id(key.id), "tiny-llama", 1)
    before = await used(client)
    await client.config_resetstat()
    for i in range(count):
        await admission.admit(key, new_request_id(key.id), "tiny-llama", 1, f"{i:04d}" + "x" * 4092)
    stats = await client.info("commandstats")
    rows.append(
        (
            "refused (4 KB x-request-id)",
            (await used(client) - before) / count,
            stats["cmdstat_evalsha"]["calls"] / count,
        )
    )
    await client.aclose()
    return rows


def _line(custom_id: str, url: str = "/v1/chat/completions") -> bytes:
    return (
        json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": url,
                "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            }
        ).encode()
        + b"\n"
    )


async def measure_objects(url: str, count: int) -> list[tuple[str, float, float]]:
    """(object, Redis bytes each, bytes its key's account counts each) per kind."""
    client = aioredis.Redis.from_url(url)
    rows = []
    account = stored_space(client, 1 << 40, 1 << 40)

    async def per_object(name: str, key_id: str, make, counted) -> None:
        before = await used(client)
        for i in range(count):
            await make(i)
        held, _ = await counted.used(key_id)
        rows.append((name, (await used(client) - before) / count, held / count))

    with tempfile.TemporaryDirectory() as directory:
        files = FileStore(client, directory, max_bytes=1 << 30, max_key_bytes=1 << 40, max_key_files=1 << 40)
        batches = BatchStore(client, files, max_requests=1000, max_active_per_key=1 << 30, records=account)
        content = b"".join(_line(f"r{i}") for i in range(100))

        async def upload(key_id: str) -> str:
            async with files.reservation(key_id, len(content)) as file_id:
                return (await files.upload(key_id, file_id, "in.jsonl", "batch", io.BytesIO(content)))["id"]

        await per_object("file (100 lines, 15 kB on disk)", "kfiles", lambda i: upload("kfiles"), files.space)
        good = await upload("kbatch")
        body = {
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "input_file_id": good,
            "metadata": {f"k{i}": "v" * 512 for i in range(16)},
        }
        await per_object(
            "batch (16 metadata pairs of 512)", "kbatch", lambda i: batches.create("kbatch", body), account
        )
        bad = await upload("kbad")
        with open(files.path("kbad", bad), "wb") as out:  # 100 lines whose url is 20,000 characters
            out.write(b"".join(_line(f"r{i}", "/v1/" + "u" * 20_000) for i in range(100)))
        await per_object(
            "batch failed (100 errors, 20 kB urls)",
            "kbad",
            lambda i: batches.create("kbad", {**body, "input_file_id": bad, "metadata": None}),
            account,
        )

    responses = ResponseStore(client, account)
    answer = {
        "object": "response",
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "word " * 50}]}
        ],
        "usage": {"input_tokens": 30, "output_tokens": 50},
    }

    async def respond(key_id: str, i: int, text: str) -> None:
        context = [{"type": "message", "role": "user", "content": text}]
        pending = await responses.reserve(key_id, 4 * len(text) + 65536)
        await responses.put(key_id, {**answer, "id": f"resp_{key_id}_{i}"}, context, context, pending)

    await per_object("stored response (1 kB input)", "kresp1", lambda i: respond("kresp1", i, "x" * 1024), account)
    await per_object("stored response (100 kB input)", "kresp2", lambda i: respond("kresp2", i, "x" * 102_400), account)
    await client.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--objects", type=int, default=200)
    args = parser.parse_args()
    with running_redis() as server:
        rows = asyncio.run(measure(server.url, args.requests))
        objects = asyncio.run(measure_objects(server.url, args.objects))
    print(f"{'request':<40} {'bytes each':>12} {'EVALSHA each':>13}")
    for name, size, calls in rows:
        print(f"{name:<40} {size:>12.1f} {calls:>13.2f}")
    print()
    print(f"{'stored object':<40} {'Redis bytes':>12} {'counted':>13}")
    for name, size, counted in objects:
        print(f"{name:<40} {size:>12.0f} {counted:>13.0f}")


if __name__ == "__main__":
    main()
