"""Pure parts of the Files and Batch API (serve_app/stored/files_api.py, batches.py,
batch_runner.py): what a batch file must hold, uploads that must leave nothing
behind, how a resumed batch reads what its dead runner wrote. The API itself
runs under real Serve in tests/e2e/quota_stack/test_1_batches_e2e.py."""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import openai_spec
import pytest
from small_disk import small_disk

from serve_app.admission.seam import Decision, Refusal
from serve_app.errors import OpenAIError
from serve_app.stored.batch_runner import BatchJob, _retry_after_s, result_file_id
from serve_app.stored.batches import as_batch
from serve_app.stored.files_api import FILE_ID, FileStore, batch_lines
from serve_app.wire.calls import Reply


def line(custom_id: str, **changes) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": []},
        **changes,
    }


def write_lines(path, lines) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in lines))


def test_a_batch_file_is_read_request_by_request_skipping_blank_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line("a")) + "\n\n" + json.dumps(line("b")))  # no final newline
    assert [(r["line"], r["custom_id"]) for r in batch_lines(path, 10, 1 << 20)] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize(
    "lines, problem",
    [
        ([line("a"), line("a")], "Line 2 of the file repeats custom_id"),
        ([line("a", method="GET")], "Line 1 of the file needs 'method'"),
        ([line("a", url=None)], "needs 'url'"),
        ([line("a", body=[1])], "needs 'body'"),
        ([line("x" * 513)], "needs 'custom_id'"),
        ([[1, 2]], "must be a JSON object"),
        ([line(str(i)) for i in range(4)], "more than 3 requests"),
    ],
)
def test_a_file_that_is_no_batch_names_its_first_bad_line(tmp_path, lines, problem):
    path = tmp_path / "in.jsonl"
    write_lines(path, lines)
    with pytest.raises(OpenAIError) as caught:
        list(batch_lines(path, 3, 1 << 20))
    assert caught.value.status == 400 and problem in caught.value.message


# What a request body may not be, a batch line may not be either (a line is a request):
# the interactive path's JSON checks, and its size bound.
@pytest.mark.parametrize(
    "raw, problem",
    [
        (b'{"custom_id": "a", "body": ' + b"[" * 2000 + b"]" * 2000 + b"}", "nested more than"),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"temperature": NaN}}',
            "NaN is not a JSON number",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"top_p": Infinity}}',
            "Infinity is not a JSON number",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"user": "\\ud800"}}',
            "unpaired",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"user": "'
            + b"x" * 5000
            + b'"}}',
            "longer than 4096 bytes",
        ),
        (b'{"custom_id": "a", "body": ' + b"[" * 200_000, "longer than 4096 bytes"),  # never parsed
    ],
)
def test_a_batch_line_passes_the_checks_a_request_body_does(tmp_path, raw, problem):
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(line("ok")).encode() + b"\n" + raw + b"\n")
    with pytest.raises(OpenAIError) as caught:
        list(batch_lines(path, 10, 4096))
    assert caught.value.status == 400 and caught.value.message.startswith("Line 2 of the file")
    assert problem in caught.value.message and len(caught.value.message) < 300


def test_a_line_exactly_at_the_bound_is_read(tmp_path):
    raw = json.dumps(line("a")).encode()
    path = tmp_path / "in.jsonl"
    path.write_bytes(raw + b"\n")
    assert next(batch_lines(path, 10, len(raw) + 1))["custom_id"] == "a"  # the newline counts
    with pytest.raises(OpenAIError):
        list(batch_lines(path, 10, len(raw) - 1))


class SpaceLedger:
    """Stands in for the key's file space in Redis (tests/integration/test_file_space.py
    runs the real one): what is reserved or recorded now."""

    def __init__(self):
        self.held: dict[str, int] = {}

    async def reserve(self, key_id, file_id, size, expires_s, now_s=None):
        self.held[file_id] = size

    async def record(self, key_id, file_id, size, expires_s, now_s=None):
        self.held[file_id] = size

    async def release(self, key_id, file_id, now_s=None):
        self.held.pop(file_id, None)


def unbounded_store(directory, max_bytes: int) -> FileStore:
    store = FileStore(None, str(directory), max_bytes=max_bytes)
    store.space = SpaceLedger()
    return store


async def test_an_upload_past_the_bound_leaves_no_file_behind(tmp_path):
    store = unbounded_store(tmp_path, max_bytes=1000)  # refused before its metadata is written
    with pytest.raises(OpenAIError) as caught:
        async with store.reservation("k1", declared_bytes=1400) as file_id:
            await store.upload("k1", file_id, "big.jsonl", "batch", io.BytesIO(b"x" * 1001))
    assert caught.value.status == 413
    assert list((tmp_path / "k1").iterdir()) == []
    assert store.space.held == {}  # its reservation is given back


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system: a disk that fills up."""
    with small_disk(tmp_path / "disk", "64k") as mount:
        yield mount


async def test_an_upload_to_a_full_disk_is_a_507_and_leaves_nothing_behind(tiny_disk):
    store = unbounded_store(tiny_disk, max_bytes=10 << 20)
    with pytest.raises(OpenAIError) as caught:
        async with store.reservation("k1", declared_bytes=210 << 10) as file_id:
            await store.upload("k1", file_id, "big.jsonl", "batch", io.BytesIO(b"x" * (200 << 10)))
    assert caught.value.status == 507 and caught.value.code == "storage_full"
    assert list((tiny_disk / "k1").iterdir()) == []  # the partial upload is gone: the disk is free again
    assert store.space.held == {}  # and the key's room with it


@pytest.mark.parametrize(
    "file_id", ["../k2/file-" + "0" * 32, "/etc/passwd", "file-" + "0" * 31 + "/", "..", "file-" + "A" * 32]
)
async def test_a_file_id_is_never_a_path(tmp_path, file_id):
    store = FileStore(None, str(tmp_path), max_bytes=10)
    with pytest.raises(OpenAIError) as caught:
        store.path("k1", file_id)
    assert caught.value.status == 404


def test_a_resumed_batch_counts_what_was_written_and_drops_a_line_cut_short(tmp_path):
    files = FileStore(None, str(tmp_path), max_bytes=10)
    job = BatchJob(SimpleNamespace(store=None, files=files), "k1", "batch_1")
    job.out.parent.mkdir(parents=True)
    answered = {
        "id": "batch_req_1",
        "custom_id": "a",
        "error": None,
        "response": {
            "status_code": 200,
            "request_id": "r",
            "body": {"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
        },
    }
    failed = {
        "id": "batch_req_2",
        "custom_id": "b",
        "error": None,
        "response": {"status_code": 400, "request_id": "r", "body": {"error": {"message": "no"}}},
    }
    job.out.write_text(json.dumps(answered) + "\n" + '{"id": "batch_req_3", "custom_id": "c", "resp')  # died here
    job.err.write_text(json.dumps(failed) + "\n")
    assert job._answered() == {"a", "b"}
    assert job.out.read_text() == json.dumps(answered) + "\n"  # "c" runs again, its half line is gone
    assert job.counts == {
        "completed": 1,
        "failed": 1,
        "input_tokens": 5,
        "cached_tokens": 0,
        "output_tokens": 3,
        "reasoning_tokens": 0,
    }


def test_a_batchs_result_files_have_ids_fixed_by_the_batch():
    assert result_file_id("batch_1", "output") == result_file_id("batch_1", "output")
    assert (
        len(
            {
                result_file_id("batch_1", "output"),
                result_file_id("batch_1", "errors"),
                result_file_id("batch_2", "output"),
            }
        )
        == 3
    )
    assert FILE_ID.fullmatch(result_file_id("batch_1", "output"))


def test_a_batch_record_is_openais_batch_object():
    fixed = {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "created_at": 1,
        "expires_at": 86401,
        "metadata": None,
    }
    batch = as_batch(
        {
            "fixed": json.dumps(fixed),
            "status": "completed",
            "in_progress_at": "2",
            "completed_at": "3",
            "output_file_id": "file-2",
            "total": "2",
            "completed": "2",
            "failed": "0",
            "input_tokens": "10",
            "output_tokens": "4",
        }
    )
    openai_spec.validate(batch, "Batch")
    assert "metadata" not in batch and "error_file_id" not in batch  # absent, not null (the spec's types)
    assert batch["usage"]["total_tokens"] == 14 and batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


@pytest.mark.parametrize(
    "status, headers, wait",
    [
        (429, {"retry-after-ms": "1500", "retry-after": "2"}, 1.5),  # a rate limit that passes
        (429, {}, None),  # larger than the key's whole limit: retrying cannot help
        (503, {"retry-after": "1"}, 1.0),  # the model is busy
        (400, {}, None),
        (403, {}, None),
        (404, {}, None),
    ],
)
def test_only_refusals_that_may_pass_are_retried(status, headers, wait):
    assert _retry_after_s(OpenAIError(status, "x", headers=headers)) == wait


# -- a batch's run, on in-memory stand-ins for Redis and the gateway -----------------------
# (The real stack runs completed, cancelled and resumed batches in
# tests/e2e/quota_stack/test_1_batches_e2e.py; a 24 h window and a full disk are
# what these cover.)


class MemoryBatches:
    """BatchStore's runner-facing calls on a dict, with its transition rule."""

    def __init__(self, fields: dict[str, str], files: FileStore):
        self.fields_ = fields
        self.files = files
        self.ended_calls = 0
        self.unstored_: dict[str, str] = {}
        self.starts: list[tuple[int, int]] = []  # where each read of the input began

    async def fields(self, key_id, batch_id):
        return dict(self.fields_)

    async def status(self, key_id, batch_id):
        return self.fields_["status"]

    async def transition(self, key_id, batch_id, status, allowed):
        was = self.fields_["status"]
        if was in allowed:
            self.fields_["status"] = status
        return was

    async def update(self, key_id, batch_id, **fields):
        self.fields_.update({k: str(v) for k, v in fields.items()})

    async def ended(self, key_id, batch_id):
        self.ended_calls += 1

    async def unstored(self, key_id, batch_id):
        return dict(self.unstored_)

    async def not_kept(self, key_id, batch_id, custom_id, why):
        self.unstored_[custom_id] = why

    def lines(self, key_id, file_id, start=(0, 0)):
        self.starts.append(start)
        return batch_lines(self.files.path(key_id, file_id), 50_000, 1 << 20, start)


class LocalFiles(FileStore):
    """The files directory as it is; file metadata in a dict instead of Redis."""

    def __init__(self, directory):
        super().__init__(None, str(directory), max_bytes=1 << 20)
        self.adopted: dict[str, str] = {}
        self.room = 1 << 62  # the key's file storage left: each result line takes its bytes from it

    async def release_result(self, key_id, file_id):
        pass

    async def grow_result(self, key_id, file_id, size):
        if size > self.room:
            return False
        self.room -= size
        return True

    async def adopt(self, key_id, written, filename, purpose, file_id):
        target = self.path(key_id, file_id)
        if written.exists():
            written.replace(target)
        self.adopted[file_id] = target.read_text()


class CountingGate:
    """The gatekeeper as a batch line failed before its admission sees it: ``room``
    requests admitted (and settled), then refusals of requests/min."""

    def __init__(self, room: int = 1 << 30):
        self.room, self.counted = room, []

    async def admit(self, key, model, tokens, http_request_id):
        if len(self.counted) >= self.room:
            decision = Decision(False, "requests", 20_000, 0, 20_000, -1, 0, "1")
            return Refusal(key, "requests", 0, decision)
        self.counted.append(http_request_id)
        return SimpleNamespace(request_id=http_request_id)

    def settle(self, ticket, status, usage=None):
        assert status == "failed"


class AnsweringGateway:
    """Answers every request at once (or refuses it with ``refusal``, before its admission)."""

    def __init__(self, refusal: OpenAIError | None = None, room: int = 1 << 30):
        self.sent, self.refusal = [], refusal
        self.catalog = SimpleNamespace(resolve=lambda model: model)
        self.access = CountingGate(room)

    def waiting(self, model):
        return 0

    async def run(self, key, operation, body, size, record, background=False):
        self.sent.append(body["messages"][0]["content"])
        if self.refusal is not None:
            raise self.refusal
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return Reply(body=json.dumps({"id": "x", "object": "chat.completion", "usage": usage}).encode())


def batch_job(tmp_path, status: str, expires_at: float, gateway, requests: int = 3, keys=None, pad: int = 0):
    """(the job, its store, its files); ``keys``: what each read of the key returns
    in turn (the last one from then on), a KeyRecord or None for a revoked key;
    ``pad``: characters of ``user`` in every request (a big file)."""
    from serve_app.identity.keys import KeyNotFound, KeyRecord, KeyStore

    files = LocalFiles(tmp_path)
    input_id = "file-" + "1" * 32
    files.path("k1", input_id).parent.mkdir(parents=True, exist_ok=True)
    write_lines(
        files.path("k1", input_id),
        [
            {
                **line(f"r{i}"),
                "body": {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"r{i}"}],
                    **({"user": "x" * pad} if pad else {}),
                },
            }
            for i in range(requests)
        ],
    )
    fixed = {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": input_id,
        "completion_window": "24h",
        "created_at": 0,
        "expires_at": expires_at,
    }
    store = MemoryBatches({"fixed": json.dumps(fixed), "status": status, "total": str(requests)}, files)
    key = KeyRecord(id="k1", name="k", created_at=0)
    reads = list(keys) if keys is not None else [key]

    async def read_key(key_id):
        found = reads.pop(0) if len(reads) > 1 else reads[0]
        if found is None:
            raise KeyNotFound(key_id)
        return found

    keys = KeyStore.__new__(KeyStore)  # its own `active`, over this `get`
    keys.get = read_key
    runner = SimpleNamespace(
        store=store,
        files=files,
        gateway=gateway,
        config=SimpleNamespace(max_requests=100, concurrency=2),
        keys=keys,
        telemetry=SimpleNamespace(finish=lambda record: None),
    )
    return BatchJob(runner, "k1", "batch_1"), store, files


def result_lines(files, kind):
    text = files.adopted.get(result_file_id("batch_1", kind), "")
    return [json.loads(item) for item in text.splitlines()]


async def test_a_batch_runs_every_request_once_and_ends_completed(tmp_path):
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "validating", time.time() + 3600, gateway)
    await job.run()
    assert sorted(gateway.sent) == ["r0", "r1", "r2"]
    assert store.fields_["status"] == "completed" and store.ended_calls == 1
    assert sorted(item["custom_id"] for item in result_lines(files, "output")) == ["r0", "r1", "r2"]
    assert store.fields_["completed"] == "3" and store.fields_["input_tokens"] == "9"
    assert not job.out.exists() and not job.err.exists()  # the partial files became the output file


async def test_a_batch_past_its_window_ends_expired_with_each_request_not_run_in_its_error_file(tmp_path):
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() - 1, gateway)
    await job.run()
    assert gateway.sent == []  # nothing is sent once the window is over
    assert store.fields_["status"] == "expired"
    errors = result_lines(files, "errors")
    assert sorted(item["custom_id"] for item in errors) == ["r0", "r1", "r2"]
    assert {item["error"]["code"] for item in errors} == {"batch_expired"} and errors[0]["response"] is None


async def test_a_batch_cancelled_before_it_ran_ends_cancelled_having_sent_nothing(tmp_path):
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "cancelling", time.time() + 3600, gateway)
    await job.run()
    assert gateway.sent == [] and store.fields_["status"] == "cancelled"
    assert {item["error"]["code"] for item in result_lines(files, "errors")} == {"batch_cancelled"}


async def test_an_answer_the_disk_will_not_take_is_never_run_again_and_the_batch_parks(tmp_path, monkeypatch):
    """The files' disk is full: the answers that ran are not kept, remembered as such (so
    a claim never runs and charges them again), and the batch parks; once the disk takes
    writes, the next claim runs only the rest and names the lost answers in its errors."""
    import errno

    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway)

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BatchJob, "_append", staticmethod(disk_full))
    await job.run()
    assert store.fields_["status"] == "in_progress" and store.ended_calls == 0 and job.park_s is not None
    lost = sorted(store.unstored_)
    assert lost and lost == sorted(gateway.sent) and set(store.unstored_.values()) == {"result_not_stored"}
    monkeypatch.undo()  # the disk has room again
    await BatchJob(job.runner, "k1", "batch_1").run()
    assert sorted(gateway.sent) == ["r0", "r1", "r2"]  # each request ran once
    assert store.fields_["status"] == "completed" and store.fields_["failed"] == str(len(lost))
    assert sorted(item["custom_id"] for item in result_lines(files, "output")) == sorted({"r0", "r1", "r2"} - set(lost))
    assert [error["code"] for error in json.loads(store.fields_["errors"])] == ["result_not_stored"]


async def test_a_batchs_results_stop_at_its_keys_storage_bound(tmp_path):
    """Each result line is counted against the key's files before it is written: the
    output never passes the room the key has; the line that does not fit is not kept,
    nothing after it runs, and the batch's errors name the bound."""
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, requests=10)
    files.room = room = 500  # about two lines
    await job.run()
    output = files.adopted.get(result_file_id("batch_1", "output"), "")
    kept = output.splitlines()
    assert 1 <= len(kept) <= 2 and len(output.encode()) <= room
    assert len(gateway.sent) == len(kept) + len(store.unstored_) <= len(kept) + 2  # what was in flight at most
    assert set(store.unstored_.values()) == {"storage_limit_exceeded"}
    assert store.fields_["status"] == "completed"
    assert store.fields_["completed"] == str(len(kept)) and store.fields_["failed"] == str(10 - len(kept))
    [error] = json.loads(store.fields_["errors"])
    assert error["code"] == "storage_limit_exceeded" and "storage bound" in error["message"]


class RefusingAfter(AnsweringGateway):
    """Answers ``answers`` requests, then refuses every one as a key out of room (a 429 to wait out)."""

    def __init__(self, answers: int):
        super().__init__()
        self.answers = answers

    async def run(self, key, operation, body, size, record, background=False):
        if len(self.sent) >= self.answers:
            self.sent.append(body["messages"][0]["content"])
            raise OpenAIError(429, "Rate limit reached.", headers={"retry-after-ms": "30000"})
        return await super().run(key, operation, body, size, record, background)


async def test_a_parked_batch_resumes_after_the_lines_it_answered_never_reading_them_again(tmp_path):
    gateway = RefusingAfter(answers=4)
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, requests=10)
    job.runner.config.concurrency = 1  # in order: the lines answered are the first four
    await job.run()
    assert job.park_s is not None and store.fields_["status"] == "in_progress"
    offset, line = map(int, store.fields_["resume_at"].split(","))
    raw = files.path("k1", "file-" + "1" * 32).read_bytes()
    assert line == 4 and offset == len(b"".join(raw.splitlines(keepends=True)[:4]))
    gateway.answers = 100  # the key has room again
    again = BatchJob(job.runner, "k1", "batch_1")
    await again.run()
    # Its input read from there; once all is answered, what is left to count starts at the end.
    assert store.starts[-2:] == [(offset, 4), (len(raw), 10)]
    assert sorted(gateway.sent) == sorted([f"r{i}" for i in range(10)] + ["r4"])  # r4 refused once, then run
    assert store.fields_["status"] == "completed" and store.fields_["completed"] == "10"


async def test_a_refusal_that_cannot_pass_is_the_requests_error_line(tmp_path):
    refusal = OpenAIError(403, "This API key may not use model 'm'.", code="model_not_allowed")
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, AnsweringGateway(refusal))
    await job.run()
    assert store.fields_["status"] == "completed" and store.fields_["failed"] == "3"
    errors = result_lines(files, "errors")
    assert {item["response"]["status_code"] for item in errors} == {403}
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_allowed" and errors[0]["error"] is None


async def test_lines_that_fail_before_admission_count_as_requests_and_park_a_key_without_room(tmp_path):
    """A request the gateway refuses before admitting it (an unknown model) is still one
    of its key's requests: a key with room for two gets two error lines, then the batch
    parks with the third line unanswered, for when the key has room."""
    refusal = OpenAIError(404, "The model 'm' does not exist.", code="model_not_found")
    gateway = AnsweringGateway(refusal, room=2)
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway)
    job.runner.config.concurrency = 1
    await job.run()
    assert len(gateway.access.counted) == 2 and job.park_s == 20.0
    assert store.fields_["status"] == "in_progress" and store.fields_["failed"] == "2"
    gateway.access.room = 3
    await BatchJob(job.runner, "k1", "batch_1").run()
    assert len(gateway.access.counted) == 3 and store.fields_["status"] == "completed"
    assert {item["response"]["status_code"] for item in result_lines(files, "errors")} == {404}


async def test_a_batch_whose_input_file_is_gone_fails_and_leaves_no_partial_results(tmp_path):
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, AnsweringGateway())
    job.out.write_text('{"custom_id": "r0"}\n')  # what an earlier runner wrote
    files.path("k1", "file-" + "1" * 32).unlink()
    await job.run()
    assert store.fields_["status"] == "failed" and "invalid_input_file" in store.fields_["errors"]
    assert not job.out.exists() and store.ended_calls == 1


async def test_a_refusal_of_the_key_parks_the_batch_with_nothing_written(tmp_path):
    budget = OpenAIError(
        429,
        "You exceeded your token quota.",
        code="insufficient_quota",
        headers={"retry-after": "3600", "retry-after-ms": "3600000"},
    )
    gateway = AnsweringGateway(budget)
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, requests=6)
    await job.run()
    # The first requests in flight were refused; nothing more was sent, nothing was
    # written, and the batch waits (at most MAX_PARK_S) for a later claim to resume it.
    assert len(gateway.sent) <= 2 and job.park_s == 60.0
    assert store.fields_["status"] == "in_progress" and store.ended_calls == 0
    assert not job.out.exists() and not job.err.exists() and files.adopted == {}


async def test_a_key_revoked_mid_batch_stops_it_and_its_requests_not_run_are_error_lines(tmp_path):
    from serve_app.identity.keys import KeyRecord

    key = KeyRecord(id="k1", name="k", created_at=0)
    gateway = AnsweringGateway()
    job, store, files = batch_job(
        tmp_path, "in_progress", time.time() + 3600, gateway, requests=8, keys=[key, key, None]
    )
    await job.run()
    assert len(gateway.sent) == 2  # the key as it was when each was sent; none after it was revoked
    assert store.fields_["status"] == "cancelled"
    errors = result_lines(files, "errors")
    assert len(errors) == 6 and {item["error"]["code"] for item in errors} == {"api_key_revoked"}
    assert len(result_lines(files, "output")) == 2


async def test_a_disabled_key_stops_its_batch_too(tmp_path):
    from serve_app.identity.keys import KeyRecord

    disabled = KeyRecord(id="k1", name="k", created_at=0, enabled=False)
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, keys=[disabled])
    await job.run()
    assert gateway.sent == [] and store.fields_["status"] == "cancelled"


async def test_a_cancel_stops_a_batch_within_the_requests_in_flight(tmp_path):
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, requests=40)
    answered = gateway.run

    async def cancel_after_the_fourth(*args, **kwargs):
        reply = await answered(*args, **kwargs)
        if len(gateway.sent) == 4:
            store.fields_["status"] = "cancelling"
        return reply

    gateway.run = cancel_after_the_fourth
    await job.run()
    assert len(gateway.sent) <= 4 + 2  # at most the batch's concurrency (2) more were in flight
    assert store.fields_["status"] == "cancelled"
    assert {item["error"]["code"] for item in result_lines(files, "errors")} == {"batch_cancelled"}


@pytest.mark.parametrize(
    "name, kept",
    [
        ("requests.jsonl", "requests.jsonl"),
        (None, "upload.jsonl"),
        ('a"b\r\nx\\y/../z\x00', "a_b__x_y_.._z_"),
        ("n" * 300, "n" * 256),
        ("donn\u00e9es %22q%22%0D%0a.jsonl", "donn\u00e9es _q___.jsonl"),
    ],
)
def test_a_file_name_is_kept_without_what_could_break_a_header_or_a_path(name, kept):
    from serve_app.stored.files_api import safe_filename

    assert safe_filename(name) == kept


async def test_a_runner_holds_the_requests_in_flight_never_its_whole_input_file(tmp_path):
    import tracemalloc

    # 400 requests of 50 KB: a 20 MB input file, read as the requests are sent.
    gateway = AnsweringGateway()
    job, store, files = batch_job(tmp_path, "in_progress", time.time() + 3600, gateway, requests=400, pad=50_000)
    tracemalloc.start()
    try:
        await job.run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(gateway.sent) == 400 and store.fields_["status"] == "completed"
    assert peak < 4_000_000, peak  # read whole and parsed, it was more than 20 MB


async def test_a_new_batch_counts_its_file_one_line_at_a_time(tmp_path):
    import tracemalloc

    from serve_app.stored.batches import BatchStore

    files = LocalFiles(tmp_path)
    path = files.path("k1", "file-" + "2" * 32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lines(
        path,
        [
            {
                **line(f"r{i}"),
                "url": "/v1/embeddings" if i % 7 == 0 else "/v1/chat/completions",
                "body": {"model": "m", "user": "x" * 50_000},
            }
            for i in range(400)
        ],
    )
    store = BatchStore.__new__(BatchStore)
    store.files, store.max_requests, store.max_line_bytes = files, 50_000, 1 << 20
    tracemalloc.start()
    try:
        total, errors = store._scan("k1", "file-" + "2" * 32, "/v1/chat/completions")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == 400 and [error["line"] for error in errors] == list(range(1, 401, 7))
    assert peak < 2_000_000, peak
