"""The soak's load: ``clients`` concurrent clients, each sending one request after
another for a key drawn Zipf-distributed over the tenants (a few keys send most
of the traffic and live at their limits; most send a little), in mixed shapes:
unary and streamed chat on the paced models (through the ingress and on a direct
route), ``n`` > 1, embeddings, batches (Files and Batch API: their requests run in the
background under the key's limits), token-dense prompts and Responses continuations
on real vLLM. Every request carries its own x-request-id, and what its client saw
(status, error code, the usage it was shown, a stream cut short) is kept as a
ledger Observation."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from soak.ledger import Observation
from soak.tenants import Tenant
from soak.topology import PACED, PACED_DIRECT, VLLM_MODEL

DENSE = "😀🎉🚀💡🔥漢字仮名交じり文தமிழ்நாடு!?!?0123456789"


BATCH_ENDED = ("completed", "failed", "expired", "cancelled")


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Load:
    base_url: str
    tenants: list[Tenant]
    seed: int
    clients: int
    with_vllm: bool
    zipf_s: float = 1.1
    observations: list[Observation] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # first byte, admitted requests
    batches: list[tuple[Tenant, str]] = field(default_factory=list)  # created, to be seen ended
    _ids: itertools.count = field(default_factory=itertools.count)

    def _weights(self) -> list[float]:
        return [1 / (rank + 1) ** self.zipf_s for rank in range(len(self.tenants))]

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=self.clients * 2, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        weights = self._weights()
        self._shapes = [(shape, weight) for shape, weight, vllm in SHAPE_TABLE if self.with_vllm or not vllm]
        async with aiohttp.ClientSession(self.base_url, connector=connector, timeout=timeout) as http:
            await asyncio.gather(
                *(self._client(http, random.Random(self.seed * 1000 + n), weights, stop) for n in range(self.clients))
            )

    async def _client(self, http, rng: random.Random, weights: list[float], stop: asyncio.Event) -> None:
        while not stop.is_set():
            tenant = rng.choices(self.tenants, weights)[0]
            shape = rng.choices([s for s, _ in self._shapes], [w for _, w in self._shapes])[0]
            seen = await shape(self, http, rng, tenant)
            self.observations.append(seen)
            if seen.status != 200 or seen.code:
                # A client backing off a little (not the whole retry-after) after a
                # refusal or a failure, as the openai SDK's retries do: a client that
                # retried a refused connection at once would flood a restarting edge.
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    def next_request_id(self) -> str:
        return f"soak-{self.seed}-{next(self._ids)}"

    async def _post(self, http, tenant: Tenant, path: str, body: dict, streaming: bool) -> Observation:
        request_id, started = self.next_request_id(), now_ms()
        headers = {"authorization": f"Bearer {tenant.secret}", "x-request-id": request_id}
        try:
            async with http.post(path, json=body, headers=headers) as response:
                if response.status != 200 or not streaming:
                    answer = await response.read()
                    return self._unary(request_id, tenant, started, response.status, answer)
                return await self._stream(request_id, tenant, started, response)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            return Observation(request_id, tenant.key_id, started, now_ms(), 0, type(exc).__name__, streaming=streaming)

    async def _upload(self, http, tenant: Tenant, content: bytes) -> tuple[Observation, str]:
        """A batch input file, uploaded as the openai SDK does (multipart); its id if stored."""
        request_id, started = self.next_request_id(), now_ms()
        headers = {"authorization": f"Bearer {tenant.secret}", "x-request-id": request_id}
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="requests.jsonl", content_type="application/jsonl")
        try:
            async with http.post("/v1/files", data=form, headers=headers) as response:
                answer = await response.read()
                seen = self._unary(request_id, tenant, started, response.status, answer)
                return seen, json.loads(answer)["id"] if response.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError, KeyError) as exc:
            return Observation(request_id, tenant.key_id, started, now_ms(), 0, type(exc).__name__), ""

    async def end_batches(self, timeout_s: float) -> tuple[dict[str, str], int]:
        """Every batch created, ended: waited for half of ``timeout_s`` (their requests
        run on after the load), then those still going cancelled, as their owner would
        (a batch whose key is over a limit or budget is parked until it may go on, up to
        its 24 h window; a cancel is a request of its key: a key at its limits is
        answered 429 and asks again, as an owner would), and waited for. Returns, for
        each batch that did not end, what was last seen of it and of its cancel; and
        how many were cancelled. (A key revoked since is answered 401: its batch's
        requests are refused as revoked, so it ends too, unseen.)"""
        began = time.monotonic()
        pending = list(self.batches)
        cancels: dict[str, str] = {}  # batch id -> its cancel's last answer
        seen: dict[str, str] = {}  # batch id -> its last status seen
        async with aiohttp.ClientSession(self.base_url, timeout=aiohttp.ClientTimeout(total=30)) as http:
            while pending and time.monotonic() - began < timeout_s:
                if time.monotonic() - began >= timeout_s / 2:
                    for tenant, batch_id in pending:
                        if cancels.get(batch_id) in ("200", "409", "404", "401"):
                            continue  # cancelled, ending already, or gone
                        headers = {"authorization": f"Bearer {tenant.secret}"}
                        try:
                            async with http.post(f"/v1/batches/{batch_id}/cancel", headers=headers) as response:
                                cancels[batch_id] = str(response.status)
                        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                            cancels[batch_id] = type(exc).__name__
                still = []
                for tenant, batch_id in pending:
                    headers = {"authorization": f"Bearer {tenant.secret}"}
                    try:
                        async with http.get(f"/v1/batches/{batch_id}", headers=headers) as response:
                            status = (await response.json()).get("status") if response.status == 200 else None
                            seen[batch_id] = f"{status or response.status}"
                            if response.status == 200 and status not in BATCH_ENDED:
                                still.append((tenant, batch_id))
                    except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as exc:
                        seen[batch_id] = type(exc).__name__
                        still.append((tenant, batch_id))
                pending = still
                if pending:
                    await asyncio.sleep(2)
        unended = {
            batch_id: f"{tenant.key_id}: last seen {seen.get(batch_id)}, its cancel answered {cancels.get(batch_id)}"
            for tenant, batch_id in pending
        }
        return unended, sum(answer == "200" for answer in cancels.values())

    def _unary(self, request_id, tenant, started, status, answer: bytes) -> Observation:
        try:
            parsed = json.loads(answer)
        except ValueError:
            parsed = {}
        if status != 200:
            error = (parsed.get("error") or {}) if isinstance(parsed, dict) else {}
            code = error.get("code") or ""
            if not isinstance(parsed, dict) or "error" not in parsed:
                code = "not-the-gateway"  # an answer of the edge (Ray's HAProxy), not in OpenAI's envelope
            message = str(error.get("message") or "")[:300] if status >= 500 else ""
            return Observation(request_id, tenant.key_id, started, now_ms(), status, str(code), message=message)
        self.latencies_ms.append(now_ms() - started)
        usage = parsed.get("usage") or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0 if prompt is not None else None))
        return Observation(request_id, tenant.key_id, started, now_ms(), 200, "", prompt, completion)

    async def _stream(self, request_id, tenant, started, response) -> Observation:
        usage, done, first = None, False, None
        try:
            async for line in response.content:
                if first is None:
                    first = now_ms()
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: ") and b'"usage"' in line:
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("error"):
                        return Observation(
                            request_id, tenant.key_id, started, now_ms(), 200, "error-event", streaming=True
                        )
                elif line.startswith(b"data: ") and b'"error"' in line:
                    code = (json.loads(line[6:]).get("error") or {}).get("code") or "error-event"
                    return Observation(request_id, tenant.key_id, started, now_ms(), 200, str(code), streaming=True)
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
            done = False
        if first is not None:
            self.latencies_ms.append(first - started)
        if not done:
            return Observation(request_id, tenant.key_id, started, now_ms(), 200, "cut", streaming=True)
        prompt = usage.get("prompt_tokens") if usage else None
        completion = usage.get("completion_tokens") if usage else None
        return Observation(request_id, tenant.key_id, started, now_ms(), 200, "", prompt, completion, streaming=True)


async def chat_unary(load: Load, http, rng, tenant) -> Observation:
    body = {"model": PACED, "messages": [{"role": "user", "content": "hello " * rng.randint(1, 40)}]}
    body["max_tokens"] = rng.randint(4, 32)
    return await load._post(http, tenant, "/v1/chat/completions", body, False)


async def chat_stream(load: Load, http, rng, tenant) -> Observation:
    body = {
        "model": rng.choice([PACED, PACED_DIRECT]),
        "messages": [{"role": "user", "content": "stream " * rng.randint(1, 40)}],
        "max_tokens": rng.randint(8, 120),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await load._post(http, tenant, "/v1/chat/completions", body, True)


async def chat_n(load: Load, http, rng, tenant) -> Observation:
    stream = rng.random() < 0.5
    body = {
        "model": PACED_DIRECT,
        "messages": [{"role": "user", "content": "choices"}],
        "max_tokens": rng.randint(4, 24),
        "n": rng.randint(2, 4),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return await load._post(http, tenant, "/v1/chat/completions", body, stream)


async def embeddings(load: Load, http, rng, tenant) -> Observation:
    body = {"model": PACED, "input": ["embed me " * rng.randint(1, 20) for _ in range(rng.randint(1, 4))]}
    return await load._post(http, tenant, "/v1/embeddings", body, False)


async def batch(load: Load, http, rng, tenant) -> Observation:
    """A small batch of paced chat requests: its file uploaded and the batch created
    (an observation each, charged as a request with no tokens); its requests run in the
    background under the key's limits (records with no client of their own)."""
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": PACED,
                "messages": [{"role": "user", "content": "batch " * rng.randint(1, 20)}],
                "max_tokens": rng.randint(4, 24),
            },
        }
        for n in range(rng.randint(2, 5))
    ]
    seen, file_id = await load._upload(http, tenant, "".join(json.dumps(line) + "\n" for line in lines).encode())
    if not file_id:
        return seen
    load.observations.append(seen)
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    request_id, started = load.next_request_id(), now_ms()
    headers = {"authorization": f"Bearer {tenant.secret}", "x-request-id": request_id}
    try:
        async with http.post("/v1/batches", json=body, headers=headers) as response:
            answer = await response.read()
            seen = load._unary(request_id, tenant, started, response.status, answer)
            if response.status == 200:
                load.batches.append((tenant, json.loads(answer)["id"]))
            return seen
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        return Observation(request_id, tenant.key_id, started, now_ms(), 0, type(exc).__name__)


async def dense_chat(load: Load, http, rng, tenant) -> Observation:
    text = "".join(rng.choice(DENSE) for _ in range(rng.randint(20, 200)))
    body = {"model": VLLM_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(4, 16)}
    return await load._post(http, tenant, "/v1/chat/completions", body, False)


async def responses_continuation(load: Load, http, rng, tenant) -> Observation:
    """A stored response, then one continuing it: the second is the observation
    (the first is one too, kept by the caller's next turn)."""
    first = {"model": VLLM_MODEL, "input": "remember this", "max_output_tokens": 8, "store": True}
    request_id, started = load.next_request_id(), now_ms()
    headers = {"authorization": f"Bearer {tenant.secret}", "x-request-id": request_id}
    try:
        async with http.post("/v1/responses", json=first, headers=headers) as response:
            answer = await response.read()
            seen = load._unary(request_id, tenant, started, response.status, answer)
            if response.status != 200:
                return seen
            load.observations.append(seen)
            previous = json.loads(answer)["id"]
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        return Observation(request_id, tenant.key_id, started, now_ms(), 0, type(exc).__name__)
    follow = {"model": VLLM_MODEL, "input": "and now?", "max_output_tokens": 8, "previous_response_id": previous}
    return await load._post(http, tenant, "/v1/responses", follow, False)


# (shape, weight, needs real vLLM)
SHAPE_TABLE = [
    (chat_unary, 30, False),
    (chat_stream, 45, False),
    (chat_n, 10, False),
    (embeddings, 8, False),
    (batch, 2, False),
    (dense_chat, 4, True),
    (responses_continuation, 3, True),
]
