"""The Files, Batch and Responses routes and the edge against a hostile tenant, on
the stack with two ingress replicas (docs/quotas.md, "Storage bounds"): every route is
admitted against the key's requests/min and concurrency; what a key stores in Redis
is bounded, refused before anything runs and given back on delete; echoed values
and batch records stay small; odd query strings, batch lines and filenames are 4xx
or kept right, never a 500; an x-request-id reused by another key never takes over
the first one's lookup; a client trickling its headers is cut off. Asserted on
records, bytes in Redis and what ran, not only on statuses."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest
from settled import inference, records, wait_until_settled
from stack import call_replica, create_key

from cluster.haproxy_edge import ONE_HOP_BODY_BYTES
from quota_stack.stack_args import ADMIN, MODEL, STORED_BYTES
from quota_stack.test_1_batches_e2e import chat_line, jsonl, sdk, upload
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def test_files_and_batch_routes_are_admitted_against_requests_per_minute(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "hostile-rpm", requests_per_minute=3)
    client = sdk(base_url, secret)
    file = upload(client, [chat_line("a")])  # the first request of the minute
    body = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with httpx.Client(base_url=base_url, headers=bearer(secret), timeout=30) as http:
        statuses = [http.post("/v1/batches", json=body).status_code for _ in range(5)]
        listing = http.get("/v1/files")
    assert statuses == [200, 200, 429, 429, 429], statuses
    assert listing.status_code == 429 and listing.json()["error"]["type"] == "requests"
    assert "retry-after" in listing.headers and listing.headers["x-ratelimit-limit-requests"] == "3"
    # Nothing was made of a refusal: two batch records, and the key's storage counts them.
    assert redis.zcard(redis_names.batch_index(key_id)) == 2
    assert int(redis.hget(redis_names.stored_space(key_id), "total")) < 2 * 64 * 1024
    for batch_id in redis.zrange(redis_names.batch_index(key_id), 0, -1):
        httpx.post(base_url + f"/admin/batches/{batch_id.decode()}/cancel", headers=ADMIN_HEADERS, timeout=30)


def test_an_upload_holds_one_of_its_keys_concurrency_slots_while_it_is_read(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "hostile-slow-upload", max_concurrent=1)
    boundary = "llmclusterboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    line = jsonl([chat_line("slow")])
    tail = f"\r\n--{boundary}--\r\n".encode()

    def trickle():
        yield head
        for _ in range(6):
            time.sleep(0.5)
            yield b" " * 10  # spaces after the line: still one JSON line
        yield line + tail

    headers = {
        **bearer(secret),
        "content-type": f"multipart/form-data; boundary={boundary}",
        "content-length": str(len(head) + 60 + len(line) + len(tail)),
    }
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, base_url + "/v1/files", content=trickle(), headers=headers, timeout=60)
        time.sleep(1.0)
        during = httpx.get(base_url + "/v1/files", headers=bearer(secret), timeout=30)
        assert slow.result().status_code == 200, slow.result().text
    assert during.status_code == 429 and during.json()["error"]["type"] == "concurrency"
    assert httpx.get(base_url + "/v1/files", headers=bearer(secret), timeout=30).status_code == 200
    wait_until_settled(redis, key_id)  # no slot left held


def test_stored_responses_are_bounded_per_key_refused_before_they_run_and_freed_by_delete(
    base_url, redis_server, redis
):
    key_id, secret = create_key(redis_server.url, "hostile-storage")
    note = "n" * (400 * 1024)  # junk in an input item: stored, never tokenized
    body = {
        "model": MODEL,
        "max_output_tokens": 2,
        "input": [{"type": "message", "role": "user", "content": "hi", "note": note}],
    }
    stored, refused = [], None
    with httpx.Client(base_url=base_url, headers=bearer(secret), timeout=120) as http:
        for _ in range(8):
            response = http.post("/v1/responses", json=body)
            if response.status_code != 200:
                refused = response
                break
            stored.append(response.json()["id"])
        assert refused is not None and refused.status_code == 400, [r for r in stored]
        error = refused.json()["error"]
        assert error["code"] == "storage_limit_exceeded" and error["param"] == "store"
        assert 1 <= len(stored) <= STORED_BYTES // len(note)
        held = sum(redis.strlen(redis_names.stored_response(key_id, rid)) for rid in stored)
        assert held <= STORED_BYTES and int(redis.hget(redis_names.stored_space(key_id), "total")) == held
        # The refusal ran nothing and charged nothing: one record per stored response.
        assert len(inference(wait_until_settled(redis, key_id))) == len(stored)
        # store false still runs; a delete gives room back for one more.
        assert http.post("/v1/responses", json={**body, "store": False}).status_code == 200
        assert http.delete(f"/v1/responses/{stored[0]}").status_code == 200
        assert http.post("/v1/responses", json=body).status_code == 200
        # A follow-up on a stored response counts its whole conversation again.
        follow_up = http.post(
            "/v1/responses",
            json={"model": MODEL, "max_output_tokens": 2, "input": "more", "previous_response_id": stored[1]},
        )
        assert follow_up.status_code == 400 and follow_up.json()["error"]["code"] == "storage_limit_exceeded"
        # OpenAI's metadata bounds, before anything is stored or run.
        for metadata in ({"k": "v" * 513}, {str(i): "v" for i in range(17)}, {"k" * 65: "v"}):
            response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata})
            assert response.status_code == 400 and response.json()["error"]["param"] == "metadata"


def test_a_refused_follow_up_never_reads_its_stored_conversation(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "hostile-follow-up", requests_per_minute=2)
    junk = {"type": "message", "role": "user", "content": "hi", "note": "n" * (256 * 1024)}
    with httpx.Client(base_url=base_url, headers=bearer(secret), timeout=120) as http:
        first = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [junk]})
        assert first.status_code == 200, first.text
        name = redis_names.stored_response(key_id, first.json()["id"])
        assert http.get(f"/v1/responses/{first.json()['id']}").status_code == 200  # the minute's second request
        follow_up = {
            "model": MODEL,
            "max_output_tokens": 2,
            "input": "more",
            "previous_response_id": first.json()["id"],
        }
        with watching(redis) as seen:
            refused = [http.post("/v1/responses", json=follow_up) for _ in range(3)]
    assert [r.status_code for r in refused] == [429] * 3 and refused[0].json()["error"]["type"] == "requests"
    # Each refusal read the record's first bytes (the history's size, to price it), never the whole record.
    on_it = [command.split()[0].upper() for command in seen if name in command]
    assert on_it == ["GETRANGE"] * 3, on_it
    assert len(inference(wait_until_settled(redis, key_id))) == 1  # only the first one ran


@contextlib.contextmanager
def watching(redis):
    """Every command the Redis server runs meanwhile (MONITOR), as text."""
    seen: list[str] = []
    marker = f"watch-ended-{time.time_ns()}"
    with redis.monitor() as monitor:  # on from here: MONITOR answered before it returns

        def read() -> None:
            while marker not in (command := monitor.next_command()["command"]):
                seen.append(command)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield seen
        finally:
            redis.echo(marker)
            reader.join(30)
    assert not reader.is_alive(), "MONITOR never saw the marker"


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches", "/v1/responses/resp_x/input_items"])
@pytest.mark.parametrize("limit", ["\u00b2", "\uff11", "9" * 40, "-1", "1e3"])
def test_an_odd_listing_limit_is_a_400_naming_it(base_url, redis_server, path, limit):
    _, secret = create_key(redis_server.url, f"hostile-limit-{abs(hash((path, limit))) % 10**8}")
    response = httpx.get(base_url + path, params={"limit": limit}, headers=bearer(secret), timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "limit", response.text
    assert len(response.text) < 400


@pytest.mark.parametrize(
    "raw, problem",
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
            + b"[" * 200_000
            + b"]" * 200_000
            + b"}",
            "nested more than",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-llama", '
            b'"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}}',
            "NaN",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-llama", '
            b'"messages": [{"role": "user", "content": "\\ud800"}]}}',
            "unpaired",
        ),
    ],
)
def test_a_batch_line_a_request_body_could_not_be_is_a_400_naming_the_line(base_url, redis_server, redis, raw, problem):
    key_id, secret = create_key(redis_server.url, f"hostile-line-{abs(hash(raw)) % 10**8}")
    client = sdk(base_url, secret)
    file = client.files.create(file=("bad.jsonl", io.BytesIO(jsonl([chat_line("ok")]) + raw + b"\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "Line 2" in caught.value.message and problem in caught.value.message
    # No batch was made and nothing ran: the key's only records are its Files and Batch calls.
    assert client.batches.list().data == [] and {r["model"] for r in records(redis, key_id)} == {""}


def test_a_batch_echoing_huge_values_stays_small_in_redis_and_in_its_listing(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "hostile-echo")
    client = sdk(base_url, secret)
    lines = [{**chat_line(f"u-{i}"), "url": "/v1/" + "u" * 20_000} for i in range(40)]
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and len(batch.errors.data) == 40
    assert all(len(error.message) < 300 for error in batch.errors.data)
    record = redis.hgetall(redis_names.batch_record(key_id, batch.id))
    assert sum(len(k) + len(v) for k, v in record.items()) < 64 * 1024
    listed = httpx.get(base_url + "/v1/batches", headers=bearer(secret), timeout=30)
    assert listed.status_code == 200 and len(listed.content) < 64 * 1024


def test_a_utf8_filename_is_kept_and_sent_back_as_rfc_5987(base_url, redis_server):
    _, secret = create_key(redis_server.url, "hostile-filename")
    client = sdk(base_url, secret)
    name = 'données-日本語 "q".jsonl'
    file = client.files.create(file=(name, io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    assert client.files.retrieve(file.id).filename == "données-日本語 _q_.jsonl"  # quotes never reach a header
    content = httpx.get(base_url + f"/v1/files/{file.id}/content", headers=bearer(secret), timeout=30)
    assert content.status_code == 200
    assert (
        "filename*=utf-8''donn%C3%A9es-%E6%97%A5%E6%9C%AC%E8%AA%9E%20_q_.jsonl"
        in content.headers["content-disposition"]
    )


def test_a_file_named_only_in_rfc_5987s_form_is_stored_under_that_name(base_url, redis_server):
    """RFC 7578 forbids ``filename*`` in a form, but curl scripts and some libraries send only that."""
    _, secret = create_key(redis_server.url, "hostile-filename-star")
    boundary = "b0undary"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f"filename*=UTF-8''%E2%82%AC%20rates%22.jsonl\r\nContent-Type: application/jsonl\r\n\r\n"
    ).encode()
    form += jsonl([chat_line("a")]) + f"\r\n--{boundary}--\r\n".encode()
    created = httpx.post(
        base_url + "/v1/files",
        content=form,
        timeout=30,
        headers={**bearer(secret), "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert created.status_code == 200, created.text
    assert created.json()["filename"] == "€ rates_.jsonl" and created.json()["bytes"] == len(jsonl([chat_line("a")]))
    content = httpx.get(base_url + f"/v1/files/{created.json()['id']}/content", headers=bearer(secret), timeout=30)
    assert content.content == jsonl([chat_line("a")])


def test_an_x_request_id_reused_by_another_key_never_takes_over_the_first_ones_lookup(base_url, redis_server, redis):
    first_id, first = create_key(redis_server.url, "hostile-xrid-first")
    other_id, other = create_key(redis_server.url, "hostile-xrid-other")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    shared = f"req-{time.time_ns()}"
    for secret in (first, other):
        response = httpx.post(
            base_url + "/v1/chat/completions", json=chat, timeout=60, headers={**bearer(secret), "x-request-id": shared}
        )
        assert response.status_code == 200 and response.headers["x-request-id"] == shared
    wait_until_settled(redis, first_id)
    wait_until_settled(redis, other_id)
    time.sleep(0.5)  # the index is written off the request's path
    with httpx.Client(base_url=base_url, headers=ADMIN_HEADERS, timeout=30) as admin:
        assert admin.get(f"/admin/requests/{shared}").json()["key_id"] == first_id
        assert admin.get(f"/admin/requests/{shared}", params={"key": other_id}).json()["key_id"] == other_id
        assert admin.get(f"/admin/requests/{shared}", params={"key": first_id}).json()["key_id"] == first_id


def test_the_edge_cuts_off_a_client_trickling_its_headers(base_url):
    address = urlparse(base_url)
    started = time.monotonic()
    with socket.create_connection((address.hostname, address.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        for _ in range(6):  # one more header line every 3 s: never a whole request
            try:
                sock.sendall(b"X-Trickle: 1\r\n")
            except OSError:
                break
            sock.settimeout(3)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            answer += chunk
            break
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 15
    # A request line past the edge's buffer (256 KiB with a direct route, as shipped: the
    # one hop reads a model's name from a body that large) is the edge's refusal.
    # (Sent by hand: httpx refuses a URL past 64 KiB.)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        query = b"a" * (ONE_HOP_BODY_BYTES + 4096)
        sock.sendall(b"GET /v1/models?x=" + query + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status_line = sock.makefile("rb").readline()
    assert status_line.split()[1] in (b"400", b"414"), status_line


def test_a_unary_call_of_a_key_revoked_while_it_runs_is_cancelled_within_seconds_charged_its_prompt(
    base_url, redis_server, redis
):
    key_id, secret = create_key(redis_server.url, "hostile-revoked-unary")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 2000,
        "min_tokens": 2000,
        "ignore_eos": True,
    }
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(
            httpx.post, base_url + "/v1/chat/completions", json=body, headers=bearer(secret), timeout=120
        )
        deadline = time.monotonic() + 30
        while not redis.zcard(redis_names.concurrency(key_id)):  # admitted: it runs
            assert time.monotonic() < deadline and not call.done(), call.done() and call.result().text
            time.sleep(0.05)
        time.sleep(1)  # well into its 2,000 tokens
        assert httpx.delete(base_url + f"/admin/keys/{key_id}", headers=ADMIN_HEADERS, timeout=30).status_code == 200
        revoked_at = time.monotonic()
        answer = call.result()
    ended_after_s = time.monotonic() - revoked_at
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text[:300]
    assert ended_after_s < 10, ended_after_s
    [record] = inference(wait_until_settled(redis, key_id))
    # Charged its prompt (a few tokens), not the 2,000 it reserved, nor what the cancel cut short.
    assert record["status"] == "failed" and int(record["completion_tokens"]) == 0
    assert 0 < int(record["prompt_tokens"]) < 100


def test_a_stream_of_a_key_revoked_while_it_runs_stops_within_seconds_charged_what_it_delivered(
    base_url, redis_server, redis
):
    key_id, secret = create_key(redis_server.url, "hostile-revoked-stream")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 2000,
        "min_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    events, revoked_at = [], None
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, headers=bearer(secret), timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 5:
                revoked = httpx.delete(base_url + f"/admin/keys/{key_id}", headers=ADMIN_HEADERS, timeout=30)
                assert revoked.status_code == 200
                revoked_at = time.monotonic()
    ended_after_s = time.monotonic() - revoked_at
    assert ended_after_s < 10, ended_after_s
    assert '"invalid_api_key"' in events[-1]  # told why, in the stream
    content_events = sum('"content"' in event for event in events)
    [record] = inference(wait_until_settled(redis, key_id))
    # Charged what it delivered (the prompt, one token per content event at most), not its 2,000 reserved.
    assert record["status"] == "failed" and int(record["completion_tokens"]) <= content_events < 2000


def test_a_key_at_its_requests_per_minute_is_refused_before_its_8_mib_bodies_are_read(base_url, redis_server, redis):
    """A key that spent its minute's one request sends 7.5 MiB chat bodies from 4
    threads to /v1 (one hop to the model's replica, as shipped) while another key
    chats: every one is its 429 (requests/min), given before its body was read (the
    replica's count of refusals before the body), and the other key is answered
    throughout. (Its latency meanwhile: bench/large_bodies.py.)"""
    _, secret = create_key(redis_server.url, f"hostile-big-{time.monotonic_ns()}", requests_per_minute=1)
    _, other = create_key(redis_server.url, f"hostile-big-other-{time.monotonic_ns()}")
    small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert (
        httpx.post(base_url + "/v1/chat/completions", json=small, headers=bearer(secret), timeout=60).status_code == 200
    )
    big = {**small, "messages": [{"role": "user", "content": "!? " * (15 * 1024 * 1024 // 6)}]}
    raw = json.dumps(big).encode()
    assert 7 * 1024 * 1024 < len(raw) < 8 * 1024 * 1024  # under the body limit: only the key's limit refuses it
    before = call_replica(MODEL, "refused_before_body")

    def flood() -> list[str]:
        outcomes = []
        with httpx.Client(base_url=base_url, headers=bearer(secret), timeout=120) as http:
            for _ in range(3):
                response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                outcomes.append(f"{response.status_code} {response.json()['error'].get('type')}")
        return outcomes

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood) for _ in range(4)]
        answered = [
            httpx.post(base_url + "/v1/chat/completions", json=small, headers=bearer(other), timeout=60).status_code
            for _ in range(8)
        ]
        outcomes = [outcome for done in floods for outcome in done.result()]
    assert outcomes == ["429 requests"] * 12, outcomes
    assert answered == [200] * 8
    assert call_replica(MODEL, "refused_before_body") - before == 12  # none of them read, none parsed


@pytest.mark.parametrize(
    "path, mistake",
    [
        ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "x"}]}),  # the gateway's 400
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),  # 404
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),  # Anthropic's 400
    ],
    ids=["bad-role", "bad-shape", "unknown-model", "anthropic"],
)
def test_large_bodies_refused_for_the_clients_mistake_count_against_requests_per_minute(
    base_url, redis_server, path, mistake
):
    """Bodies past ``ingress.room_check_bytes`` that the gateway reads and refuses for the
    client's mistake (a 4xx before admission) each take one of the key's requests: a
    key of 3 requests/min sending 6 such 400 KiB bodies gets 3 of its 4xx, then its
    429 before the next is read (the replica's count of refusals before the body) —
    reading and parsing them is never free. (Before: 6 of 6 were read, parsed and
    refused, and the key's minute stayed untouched.)"""
    _, secret = create_key(redis_server.url, f"hostile-mistakes-{time.monotonic_ns()}", requests_per_minute=3)
    body = {"model": MODEL, "padding": "x" * (400 * 1024), **mistake}
    raw = json.dumps(body).encode()
    before = call_replica(MODEL, "refused_before_body")
    statuses = [
        httpx.post(
            base_url + path, content=raw, headers={**bearer(secret), "content-type": "application/json"}, timeout=60
        ).status_code
        for _ in range(6)
    ]
    expected = 404 if mistake.get("model") else 400
    assert statuses == [expected] * 3 + [429] * 3, statuses
    if path.startswith("/v1/c") and "model" not in mistake:  # one hop to the model's replica: its count
        assert call_replica(MODEL, "refused_before_body") - before == 3
