"""Pure parts of the Files and Batch API (serve_app/files_api.py, batches.py,
batch_runner.py): what a batch file must hold, uploads that must leave nothing
behind, how a resumed batch reads what its dead runner wrote. The API itself
runs under real Serve in tests/e2e/quota_stack/test_1_batches_e2e.py."""

from __future__ import annotations

import io
import json
import subprocess
from types import SimpleNamespace

import pytest

import openai_spec
from serve_app.batch_runner import BatchJob, _retry_after_s, result_file_id
from serve_app.batches import as_batch
from serve_app.errors import OpenAIError
from serve_app.files_api import FILE_ID, FileStore, read_batch_requests


def line(custom_id: str, **changes) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": []}, **changes}


def write_lines(path, lines) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in lines))


def test_a_batch_file_is_read_request_by_request_skipping_blank_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line("a")) + "\n\n" + json.dumps(line("b")))  # no final newline
    assert [(r["line"], r["custom_id"]) for r in read_batch_requests(path, 10)] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize("lines, problem", [
    ([line("a"), line("a")], "Line 2 of the file repeats custom_id"),
    ([line("a", method="GET")], "Line 1 of the file needs 'method'"),
    ([line("a", url=None)], "needs 'url'"),
    ([line("a", body=[1])], "needs 'body'"),
    ([line("x" * 513)], "needs 'custom_id'"),
    ([[1, 2]], "is not a JSON object"),
    ([line(str(i)) for i in range(4)], "more than 3 requests"),
])
def test_a_file_that_is_no_batch_names_its_first_bad_line(tmp_path, lines, problem):
    path = tmp_path / "in.jsonl"
    write_lines(path, lines)
    with pytest.raises(OpenAIError) as caught:
        read_batch_requests(path, 3)
    assert caught.value.status == 400 and problem in caught.value.message


async def test_an_upload_past_the_bound_leaves_no_file_behind(tmp_path):
    store = FileStore(None, str(tmp_path), max_bytes=1000)  # refused before Redis is asked
    with pytest.raises(OpenAIError) as caught:
        await store.upload("k1", "big.jsonl", "batch", io.BytesIO(b"x" * 1001))
    assert caught.value.status == 413
    assert list((tmp_path / "k1").iterdir()) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system: a disk that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


async def test_an_upload_to_a_full_disk_is_a_507_and_leaves_nothing_behind(tiny_disk):
    store = FileStore(None, str(tiny_disk), max_bytes=10 << 20)
    with pytest.raises(OpenAIError) as caught:
        await store.upload("k1", "big.jsonl", "batch", io.BytesIO(b"x" * (200 << 10)))
    assert caught.value.status == 507 and caught.value.code == "storage_full"
    assert list((tiny_disk / "k1").iterdir()) == []  # the partial upload is gone: the disk is free again


@pytest.mark.parametrize("file_id", ["../k2/file-" + "0" * 32, "/etc/passwd", "file-" + "0" * 31 + "/", "..",
                                     "file-" + "A" * 32])
async def test_a_file_id_is_never_a_path(tmp_path, file_id):
    store = FileStore(None, str(tmp_path), max_bytes=10)
    with pytest.raises(OpenAIError) as caught:
        store.path("k1", file_id)
    assert caught.value.status == 404


def test_a_resumed_batch_counts_what_was_written_and_drops_a_line_cut_short(tmp_path):
    files = FileStore(None, str(tmp_path), max_bytes=10)
    job = BatchJob(SimpleNamespace(store=None, files=files), "k1", "batch_1")
    job.out.parent.mkdir(parents=True)
    answered = {"id": "batch_req_1", "custom_id": "a", "error": None,
                "response": {"status_code": 200, "request_id": "r", "body": {"usage": {
                    "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}}}
    failed = {"id": "batch_req_2", "custom_id": "b", "error": None,
              "response": {"status_code": 400, "request_id": "r", "body": {"error": {"message": "no"}}}}
    job.out.write_text(json.dumps(answered) + "\n" + '{"id": "batch_req_3", "custom_id": "c", "resp')  # died here
    job.err.write_text(json.dumps(failed) + "\n")
    assert job._answered() == {"a", "b"}
    assert job.out.read_text() == json.dumps(answered) + "\n"  # "c" runs again, its half line is gone
    assert job.counts == {"completed": 1, "failed": 1, "input_tokens": 5, "cached_tokens": 0, "output_tokens": 3,
                          "reasoning_tokens": 0}


def test_a_batchs_result_files_have_ids_fixed_by_the_batch():
    assert result_file_id("batch_1", "output") == result_file_id("batch_1", "output")
    assert len({result_file_id("batch_1", "output"), result_file_id("batch_1", "errors"),
                result_file_id("batch_2", "output")}) == 3
    assert FILE_ID.fullmatch(result_file_id("batch_1", "output"))


def test_a_batch_record_is_openais_batch_object():
    fixed = {"id": "batch_1", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
             "completion_window": "24h", "created_at": 1, "expires_at": 86401, "metadata": None}
    batch = as_batch({"fixed": json.dumps(fixed), "status": "completed", "in_progress_at": "2", "completed_at": "3",
                      "output_file_id": "file-2", "total": "2", "completed": "2", "failed": "0",
                      "input_tokens": "10", "output_tokens": "4"})
    openai_spec.validate(batch, "Batch")
    assert "metadata" not in batch and "error_file_id" not in batch  # absent, not null (the spec's types)
    assert batch["usage"]["total_tokens"] == 14 and batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


@pytest.mark.parametrize("status, headers, wait", [
    (429, {"retry-after-ms": "1500", "retry-after": "2"}, 1.5),  # a rate limit that passes
    (429, {}, None),  # larger than the key's whole limit: retrying cannot help
    (503, {"retry-after": "1"}, 1.0),  # the model is busy
    (400, {}, None), (403, {}, None), (404, {}, None),
])
def test_only_refusals_that_may_pass_are_retried(status, headers, wait):
    assert _retry_after_s(OpenAIError(status, "x", headers=headers)) == wait
