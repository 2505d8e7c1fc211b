"""OpenAI's Files and Batch API with the official SDK, on the stack with two
ingress replicas: a batch's requests run through the gateway (the key's models
and quotas, charged as they run), its results are files in OpenAI's format, a
cancel stops it, and a batch whose ingress replica is killed is finished by the
other, each request answered once."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import openai_spec
import pytest
from settled import inference, records, wait_until_settled
from small_disk import fill, small_disk
from stack import create_key

from quota_stack.ingresses import wait_until_both_ingresses_serve
from quota_stack.stack_args import (
    FILES_DIR,
    KEY_FILE_BYTES,
    MAX_ACTIVE_BATCHES,
    MAX_FILE_BYTES,
    MODEL,
    NARROW,
    NARROW_ALIAS,
)
from serve_app.redis_store import redis_names
from serve_app.settings import BatchConfig

pytestmark = pytest.mark.e2e

ENDED = ("completed", "failed", "expired", "cancelled")


def sdk(base_url: str, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str = MODEL, max_tokens: int = 4, **extra) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Say {custom_id}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        },
    }


def upload(client: openai.OpenAI, lines: list[dict]):
    raw = client.files.with_raw_response.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    openai_spec.validate(raw.http_response.json(), "OpenAIFile")
    return raw.parse()


def start(client: openai.OpenAI, lines: list[dict]):
    file = upload(client, lines)
    raw = client.batches.with_raw_response.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"test": "batches"}
    )
    openai_spec.validate(raw.http_response.json(), "Batch")
    return raw.parse()


def wait_for(client: openai.OpenAI, batch_id: str, until, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        raw = client.batches.with_raw_response.retrieve(batch_id)
        openai_spec.validate(raw.http_response.json(), "Batch")
        batch = raw.parse()
        if until(batch):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)


def ended(batch) -> bool:
    return batch.status in ENDED


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_of_fifty_requests_on_two_models_is_answered_and_charged_what_it_used(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "batch-fifty")
    client = sdk(base_url, secret)
    lines = [chat_line(f"req-{i}", model=MODEL if i % 2 else NARROW_ALIAS, max_tokens=3 + i % 5) for i in range(50)]
    batch = start(client, lines)
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 50
    batch = wait_for(client, batch.id, ended)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (50, 0)
    assert batch.error_file_id is None
    output = lines_of(client, batch.output_file_id)
    by_id = {line["custom_id"]: line for line in output}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines) and len(output) == 50  # each once
    for request in lines:
        line = by_id[request["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["id"].startswith("batch_req_")
        body = line["response"]["body"]
        openai_spec.validate(body, "CreateChatCompletionResponse")
        assert body["model"] == (MODEL if request["body"]["model"] == MODEL else NARROW)  # the model asked
        assert body["usage"]["completion_tokens"] <= request["body"]["max_tokens"]
    # The key was charged, request by request, exactly what the output file reports.
    used = sum(line["response"]["body"]["usage"]["total_tokens"] for line in output)
    # (The narrow model, one request at a time and a queue of one, refuses some with
    # 503: refusals charge nothing and the runner sends them again.)
    charged = inference(wait_until_settled(redis, key_id))
    assert sum(r["status"] == "completed" for r in charged) == 50, charged
    assert {r["status"] for r in charged} <= {"completed", "overloaded"}, charged
    assert sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in charged) == used
    assert batch.usage.total_tokens == used
    # Listed among the key's batches and files; the output file is OpenAI's.
    assert batch.id in [b.id for b in client.batches.list(limit=5)]
    listed = client.files.with_raw_response.list()
    openai_spec.validate(listed.http_response.json(), "ListFilesResponse")
    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.id in [f.id for f in listed.parse()]


def test_each_bad_request_of_a_batch_is_a_line_of_its_error_file_with_what_a_client_would_get(
    base_url, redis_server, redis
):
    key_id, secret = create_key(redis_server.url, "batch-bad-lines", models=[MODEL])
    client = sdk(base_url, secret)
    lines = [
        chat_line("fine"),
        chat_line("not-allowed", model=NARROW),  # a model this key may not use
        chat_line("unknown", model="no-such-model"),
        chat_line("streamed", stream=True),
        chat_line("odd-type", max_tokens="lots"),
        chat_line("huge", max_tokens=10**30),
    ]
    batch = wait_for(client, start(client, lines).id, ended)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 5)
    [ok] = lines_of(client, batch.output_file_id)
    assert ok["custom_id"] == "fine"
    errors = {line["custom_id"]: line["response"] for line in lines_of(client, batch.error_file_id)}
    assert {name: response["status_code"] for name, response in errors.items()} == {
        "not-allowed": 404,  # answered as a model that does not exist
        "unknown": 404,
        "streamed": 400,
        "odd-type": 400,
        "huge": 400,
    }
    for response in errors.values():
        assert set(response["body"]["error"]) >= {"message", "type", "param", "code"}
    assert "max_tokens" in errors["odd-type"]["body"]["error"]["message"] + str(
        errors["odd-type"]["body"]["error"]["param"]
    )
    charged = inference(wait_until_settled(redis, key_id))
    assert [r for r in charged if r["status"] == "completed"] and len(charged) <= 2  # refused before admission


def test_a_cancelled_batch_stops_running_and_reports_what_ran(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "batch-cancel")
    client = sdk(base_url, secret)
    lines = [chat_line(f"long-{i}", max_tokens=48, min_tokens=48, ignore_eos=True) for i in range(40)]
    batch = start(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = wait_for(client, batch.id, ended, timeout_s=120)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert 2 <= len(output) < 40 and len(output) + len(errors) == 40
    assert sorted(line["custom_id"] for line in output + errors) == sorted(line["custom_id"] for line in lines)
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(output), len(errors))
    # Nothing runs after it ended, no slot is left held, and only what ran was charged.
    charged = inference(wait_until_settled(redis, key_id))
    time.sleep(2)
    assert len(inference(records(redis, key_id))) == len(charged) == len(output)
    assert redis.zcard(redis_names.concurrency(key_id)) == 0
    with pytest.raises(openai.ConflictError):  # it ended: no second cancel
        client.batches.cancel(batch.id)


def test_a_batch_survives_the_death_of_the_ingress_replica_running_it(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "batch-resumed")
    # The SDK's own retries: until HAProxy's health check takes the dead replica out,
    # a poll may reach it and get a 502 or a reset connection, as any client would.
    client = sdk(base_url, secret).with_options(max_retries=5)
    lines = [chat_line(f"r-{i}", max_tokens=24, min_tokens=24, ignore_eos=True) for i in range(30)]
    batch = start(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 3)
    owner = redis.get(redis_names.batch_lease(key_id, batch.id)).decode()
    pid = int(owner.split(":")[1])
    os.kill(pid, signal.SIGKILL)  # the replica running it dies mid-batch, as on a crashed node
    batch = wait_for(client, batch.id, ended, timeout_s=300)
    assert batch.status == "completed", batch
    output = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)  # once each
    assert batch.request_counts.completed == 30 and batch.error_file_id is None
    # Out of the runners' set and its lease given up, just after it ended.
    deadline = time.monotonic() + 10
    while redis.exists(redis_names.batch_lease(key_id, batch.id)) or redis.sismember(
        redis_names.ACTIVE_BATCHES, f"{key_id}/{batch.id}"
    ):
        assert time.monotonic() < deadline, "the ended batch is still leased or active"
        time.sleep(0.1)
    # The stack as the next module expects it: two ingress replicas serving.
    wait_until_both_ingresses_serve(base_url, secret, MODEL)


def test_a_batch_whose_runners_entry_was_lost_still_runs(base_url, redis_server, redis):
    """A Redis failover can lose the write that puts a new batch where runners find
    it (one set for every key; the dying primary had not replicated it), and a
    runner can lose its lease: the batch is found again from its key's places
    within ``batch.reconcile_s`` (5 s here) and finished, each request once."""
    key_id, secret = create_key(redis_server.url, "batch-entry-lost")
    client = sdk(base_url, secret)
    lines = [chat_line(f"lost-{i}", max_tokens=24, min_tokens=24, ignore_eos=True) for i in range(20)]
    batch = start(client, lines)
    member = f"{key_id}/{batch.id}"
    lost_at = time.monotonic()
    while time.monotonic() - lost_at < 1.5:  # lost, and any runner that took it meanwhile loses it
        redis.srem(redis_names.ACTIVE_BATCHES, member)
        redis.delete(redis_names.batch_lease(key_id, batch.id))
        time.sleep(0.05)
    assert not redis.sismember(redis_names.ACTIVE_BATCHES, member)
    assert client.batches.retrieve(batch.id).status not in ENDED  # only the reconciliation can finish it now
    batch = wait_for(client, batch.id, ended, timeout_s=120)
    assert batch.status == "completed", batch
    output = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)  # once each


def test_files_and_batches_belong_to_their_key(base_url, redis_server, redis):
    _, secret = create_key(redis_server.url, "batch-owner")
    _, other_secret = create_key(redis_server.url, "batch-other")
    owner, other = sdk(base_url, secret), sdk(base_url, other_secret)
    batch = start(owner, [chat_line("canary-5ab1")])
    file_id = batch.input_file_id
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.files.list().data == [] and other.batches.list().data == []
    wait_for(owner, batch.id, ended)
    assert owner.files.retrieve(file_id).id == file_id  # the other key's delete did nothing
    deleted = owner.files.with_raw_response.delete(file_id)
    openai_spec.validate(deleted.http_response.json(), "DeleteFileResponse")
    with pytest.raises(openai.NotFoundError):
        owner.files.content(file_id)
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for method, path in (
            ("GET", "/v1/files"),
            ("POST", "/v1/files"),
            ("GET", "/v1/batches"),
            ("POST", "/v1/batches"),
            ("GET", f"/v1/batches/{batch.id}"),
        ):
            assert http.request(method, path).status_code == 401
        auth = {"authorization": f"Bearer {secret}"}
        for path in ("/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/file-..%2Fx/content", "/v1/files/%2Fetc%2Fpasswd"):
            response = http.get(path, headers=auth)
            assert response.status_code == 404 and "root:" not in response.text, (path, response.text)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n', "Line 2"),
        (jsonl([chat_line("same"), chat_line("same")]), "repeats custom_id"),
        (jsonl([{**chat_line("x"), "method": "GET"}]), "method"),
        (jsonl([{**chat_line("x"), "body": "hi"}]), "body"),
        (jsonl([{**chat_line("x"), "custom_id": 7}]), "custom_id"),
        (b"", "no requests"),
        (b"\xff\xfe\n", "Line 1"),
    ],
)
def test_a_file_that_is_no_batch_gets_a_400_naming_the_line(base_url, redis_server, redis, content, problem):
    _, secret = create_key(redis_server.url, f"batch-bad-file-{abs(hash(content)) % 10**8}")
    client = sdk(base_url, secret)
    file = client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert problem in caught.value.message
    assert client.batches.list().data == []  # no batch was made


def test_bad_uploads_and_batch_parameters_are_4xx_and_leave_nothing(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "batch-bad-params")
    client = sdk(base_url, secret)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert caught.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="fine-tune")
    assert client.files.list().data == [] and redis.zcard(redis_names.file_index(key_id)) == 0
    file = upload(client, [chat_line("a"), {**chat_line("b"), "url": "/v1/embeddings"}])
    for params, param in (
        ({"completion_window": "1h"}, "completion_window"),
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"metadata": {"k": ["not", "a", "string"]}}, "metadata"),
        ({"input_file_id": 7}, "input_file_id"),
    ):
        body = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **params}
        response = httpx.post(base_url + "/v1/batches", json=body, headers={"authorization": f"Bearer {secret}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    # A request for another endpoint: the batch fails at once, naming the line.
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and [(e.line, e.param) for e in batch.errors.data] == [(2, "url")]
    time.sleep(1)
    assert inference(records(redis, key_id)) == []  # nothing of it ran


def test_a_flood_of_uploads_never_puts_more_than_the_keys_bound_on_the_disk(base_url, redis_server, redis):
    """A hostile key uploads 8 files of nearly the largest size at once: each reserves
    its room before a byte is written, so 4 fit the key's 4 MiB and the rest are
    refused; the disk holds what was admitted and nothing else, a delete makes room,
    and another key is not affected."""
    key_id, secret = create_key(redis_server.url, "files-flood")
    client = sdk(base_url, secret)
    content = b"z" * (MAX_FILE_BYTES - 16 * 1024)  # a multipart form adds a few hundred bytes

    def attempt(i: int):
        try:
            return client.files.create(file=(f"f{i}.jsonl", io.BytesIO(content)), purpose="batch")
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, range(8)))
    stored = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(stored) == KEY_FILE_BYTES // MAX_FILE_BYTES == 4, outcomes
    for exc in refused:
        error = exc.response.json()["error"]
        assert exc.status_code == 400 and error["code"] == "file_storage_limit_exceeded" and error["param"] == "file"
    # What is on the disk is what was admitted; Redis counts exactly that.
    on_disk = sorted(Path(FILES_DIR, key_id).iterdir())
    assert sorted(p.name for p in on_disk) == sorted(f.id for f in stored)
    assert all(p.stat().st_size == len(content) for p in on_disk)
    assert int(redis.hget(redis_names.file_space(key_id), "total")) == 4 * len(content)
    # Another key has its own room; a delete gives this one room for one more.
    _, other_secret = create_key(redis_server.url, "files-flood-other")
    assert sdk(base_url, other_secret).files.create(file=("o.jsonl", io.BytesIO(content)), purpose="batch").id
    assert isinstance(attempt(8), openai.BadRequestError)
    client.files.delete(stored[0].id)
    assert client.files.create(file=("again.jsonl", io.BytesIO(content)), purpose="batch").id
    assert len(list(Path(FILES_DIR, key_id).iterdir())) == 4


def test_a_key_with_its_bound_of_batches_not_ended_gets_a_429_until_one_ends(base_url, redis_server, redis):
    """Batches held in progress (a key of 40 tokens/min: a line reserves ~25, so its
    batches park for the limit) up to the bound; one more is refused before its file
    is read and nothing is made of it; a cancelled one ending makes room."""
    key_id, secret = create_key(redis_server.url, "batch-bound", tokens_per_minute=40)
    client = sdk(base_url, secret)
    file = upload(client, [chat_line("a"), chat_line("b")])

    def create():
        return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")

    made = [create() for _ in range(MAX_ACTIVE_BATCHES)]
    with pytest.raises(openai.RateLimitError) as refused:
        create()
    assert refused.value.response.json()["error"]["code"] == "too_many_active_batches"
    assert len(client.batches.list(limit=10).data) == MAX_ACTIVE_BATCHES  # nothing was made of it
    # Which of them a runner holds now is the runners' choice: all are cancelled,
    # and the first to end makes room.
    for batch in made:
        client.batches.cancel(batch.id)
    deadline = time.monotonic() + 120
    while not any(ended(b) for b in (client.batches.retrieve(batch.id) for batch in made)):
        assert time.monotonic() < deadline, [client.batches.retrieve(batch.id).status for batch in made]
        time.sleep(0.5)
    made.append(create())  # the place the cancelled one left
    client.batches.cancel(made[-1].id)  # the stack as the next test expects it: nothing running
    for batch in made:
        assert wait_for(client, batch.id, ended, timeout_s=120).status == "cancelled"
    assert redis.zcard(redis_names.active_batches_of(key_id)) == 0


BATCH_CONCURRENCY = BatchConfig().concurrency  # a batch's requests in flight at once


def completion_line(custom_id: str, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_a_batch_whose_answers_outgrow_its_keys_storage_stops_at_the_bound(base_url, redis_server, redis):
    """Results are storage: completions with echo and 20 logprobs answer ~1,000 times
    their input (here ~1 MB each from 2 KB). Each result line is counted against the
    key's files (KEY_FILE_BYTES) before it is written: the batch stops at the bound, its
    output never takes the key past it, its errors name the bound, and the requests that
    did not run are failed, not charged."""
    key_id, secret = create_key(redis_server.url, f"batch-outgrows-{time.monotonic_ns()}")
    client = sdk(base_url, secret)
    prompt = " ".join(f"w{i}" for i in range(400))
    lines = [completion_line(f"big-{i}", prompt, echo=True, logprobs=20) for i in range(12)]
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(client, batch.id, ended, timeout_s=600)
    assert done.status == "completed", done
    assert [error.code for error in done.errors.data] == ["storage_limit_exceeded"], done.errors
    counts = done.request_counts
    assert counts.total == 12 and 1 <= counts.completed < 12 and counts.completed + counts.failed == 12
    output = client.files.content(done.output_file_id).content
    assert len(output.splitlines()) == counts.completed
    used = int(redis.hget(redis_names.file_space(key_id), "total"))
    assert used <= KEY_FILE_BYTES and len(output) + file.bytes <= KEY_FILE_BYTES
    # Charged: what ran (kept, and at most what was in flight at the bound), nothing for the rest.
    ran = [record for record in inference(wait_until_settled(redis, key_id)) if record["status"] == "completed"]
    assert counts.completed <= len(ran) <= counts.completed + BATCH_CONCURRENCY, (len(ran), counts)


def test_a_batch_on_a_full_disk_runs_and_charges_each_request_at_most_once(base_url, redis_server, redis):
    """The key's files on a disk that fills (a tmpfs at its folder of files_dir): the
    answers that ran and could not be written are not kept and never run again; the
    batch parks until the disk has room, then runs only the rest. Each of its 8
    requests is charged once, whatever was lost."""
    key_id, secret = create_key(redis_server.url, f"batch-full-disk-{time.monotonic_ns()}")
    client = sdk(base_url, secret)
    prompt = " ".join(f"w{i}" for i in range(60))  # an answer of ~100 KB: echo and 20 logprobs a token
    lines = [completion_line(f"disk-{i}", prompt, echo=True, logprobs=20) for i in range(8)]
    with small_disk(Path(FILES_DIR) / key_id, "16m") as disk:
        file = upload(client, lines)
        filler = fill(disk, leave_bytes=96 * 1024)  # room for a claim to start, none for an answer
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(client, batch.id, lambda b: b.request_counts.failed > 0, timeout_s=120)  # answers lost: it parks
        filler.unlink()  # the disk has room again: the batch's next claim runs the rest
        done = wait_for(client, batch.id, ended, timeout_s=300)
        output = client.files.content(done.output_file_id).content.splitlines()
    assert done.status == "completed", done
    lost = done.request_counts.failed  # what was in flight when the disk refused: at most a round of them
    assert done.request_counts.completed == 8 - lost and 1 <= lost <= BATCH_CONCURRENCY
    assert [error.code for error in done.errors.data] == ["result_not_stored"]
    custom_ids = [json.loads(line)["custom_id"] for line in output]
    assert len(custom_ids) == len(set(custom_ids)) == 8 - lost
    ran = [record for record in inference(wait_until_settled(redis, key_id)) if record["status"] == "completed"]
    assert len(ran) == 8  # each request charged once: the lost ones were not run again
