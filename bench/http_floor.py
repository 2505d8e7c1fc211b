"""The HTTP floor under issue 57's CPU targets: what a streamed chat request costs a
Python process that answers HTTP itself, with no Ray Serve and no gateway work.

gateway_capacity.py's ``floor`` target is a Serve deployment (HAProxy, Serve's replica
HTTP path, FastAPI) around the instant engine; this script takes Serve away and runs
the same handler in uvicorn (uvloop, httptools), in one process, two ways:

- ``fastapi``: FastAPI's route, the body validated with vLLM's request model, the
  instant engine's events coalesced as the replica relays them (replicas/streaming.py);
- ``asgi``: the same validation, engine and coalescing under a bare ASGI callable (no
  routing, no middleware, no Starlette response).

It reports the server process' CPU per request and per streamed token, as medians of
``--repeats`` loads driven at each concurrency (gateway_capacity.py's client). What it
says is the lowest CPU a one-hop path in Python can reach on this box with these
libraries, whatever the gateway does on top.

    python bench/http_floor.py [--tokens 64] [--concurrency 1 32] [--duration 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fastapi import Request  # at module level: FastAPI resolves the route's annotation here

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TARGETS = ("asgi", "fastapi")


def build(kind: str):
    """The ASGI application of ``kind`` (made in the server process)."""
    from gateway_capacity import INSTANT_ENGINE, MODEL

    from contract.model_config import ModelConfig
    from replicas.instant_engine import start_instant
    from replicas.streaming import coalesce

    config = ModelConfig(name=MODEL, engine=INSTANT_ENGINE)
    binding = asyncio.new_event_loop().run_until_complete(start_instant(config))
    validator, _, handler = binding.endpoints["chat"]
    interval_s = config.stream_batch_interval_ms / 1000
    streams = [0]

    async def relayed(body: bytes):
        events = await handler(validator.validate_python(json.loads(body)))
        streams[0] += 1
        try:
            async for text in coalesce(events, interval_s, busy=lambda: streams[0] > 1):
                yield text.encode() if isinstance(text, str) else text
        finally:
            streams[0] -= 1

    if kind == "fastapi":
        from fastapi import FastAPI
        from starlette.responses import StreamingResponse

        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return StreamingResponse(relayed(await request.body()), media_type="text/event-stream")

        return app

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for chunk in relayed(body):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def serve(kind: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build(kind), host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")


def run(kind: str, args) -> dict[int, dict]:
    import psutil
    from gateway_capacity import drive
    from serving_overhead import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # listening: a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, f"{kind} did not start"
                time.sleep(0.3)
        process = psutil.Process(server.pid)

        def server_cpu() -> dict[str, float]:
            times = process.cpu_times()
            return {"server": times.user + times.system}

        def load(concurrency: int, duration_s: float) -> dict:
            return asyncio.run(drive(url, "unused", args.tokens, concurrency, duration_s, read_cpu=server_cpu))

        load(4, 2.0)  # warm-up
        return {c: load(c, args.duration) for c in args.concurrency}
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--serve", choices=TARGETS, help=argparse.SUPPRESS)  # the child: the server itself
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0
    runs: dict[str, list[dict[int, dict]]] = {kind: [] for kind in args.targets}
    for _ in range(args.repeats):  # interleaved: the box's drift falls on every target
        for kind in args.targets:
            runs[kind].append(run(kind, args))
    print("| target | c | req/s | µs/req | µs/tok | repeats (µs/req) |")
    print("|---|---|---|---|---|---|")
    for kind, repeats in runs.items():
        for c in args.concurrency:
            figures = [repeat[c] for repeat in repeats]
            median = {
                key: statistics.median(f[key] for f in figures)
                for key in ("requests_s", "server_us_per_request", "server_us_per_token")
            }
            spread = " / ".join(f"{f['server_us_per_request']:,.0f}" for f in figures)
            failed = sum(f["failures"] for f in figures)
            print(
                f"| {kind} | {c} | {median['requests_s']:.0f} | {median['server_us_per_request']:,.0f} "
                f"| {median['server_us_per_token']:.1f} "
                f"| {spread}{f' ({failed} failed)' if failed else ''} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
