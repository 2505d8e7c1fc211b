"""The record sink's files (serve_app/accounting/record_sink.py): where a record is filed,
how it is found again by request id or x-request-id, and what the retention removes.
Shipping through Redis: tests/integration/test_record_shipping.py."""

from __future__ import annotations

import json
import time

import pytest
from small_disk import small_disk

from serve_app.accounting.record_sink import RecordSink
from serve_app.accounting.usage import _OUR_ID, id_time, new_request_id

HOUR_MS = 3600 * 1000


def record(request_id: str, received_ms: int, **fields) -> dict:
    return {
        "id": request_id,
        "key_id": request_id.partition("-")[0],
        "status": "completed",
        "received_ms": received_ms,
        **fields,
    }


def test_a_request_id_says_when_it_was_made():
    before = int(time.time()) * 1000
    request_id = new_request_id("kabc")
    assert _OUR_ID.match(request_id) and before <= id_time(request_id) <= before + 2000
    assert id_time("kabc-0123456789abcdef") is None  # made before ids carried their time
    assert _OUR_ID.match("kabc-0123456789abcdef")


def test_records_are_filed_by_the_hour_they_were_received_one_file_per_writer(tmp_path):
    sink = RecordSink(str(tmp_path), retention_s=86400)
    at = 1_790_000_000_000  # 2026-09-21 14:13 UTC
    written = sink.append("w1", [record("ka-1", at), record("ka-2", at + HOUR_MS)])
    sink.append("w2", [record("kb-1", at)])
    files = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.jsonl"))
    assert files == ["20260921/14/w1.jsonl", "20260921/14/w2.jsonl", "20260921/15/w1.jsonl"]
    assert written == sum(
        len(line) + 1
        for line in (json.dumps(record(i, t), separators=(",", ":")) for i, t in (("ka-1", at), ("ka-2", at + HOUR_MS)))
    )


def test_a_record_is_found_by_its_id_in_the_hour_the_id_names(tmp_path):
    sink = RecordSink(str(tmp_path), retention_s=86400)
    request_id = new_request_id("kabc")
    when = id_time(request_id)
    sink.append("w1", [record(new_request_id("kabc"), when), record(request_id, when + 5, prompt_tokens=7)])
    assert sink.find(request_id)["prompt_tokens"] == 7
    assert sink.find(new_request_id("kabc")) is None
    # Only the hour the id names (and its neighbours) is read: a copy filed a day away is not.
    far = RecordSink(str(tmp_path / "far"), retention_s=86400)
    far.append("w1", [record(request_id, when - 24 * HOUR_MS)])
    assert far.find(request_id) is None


def test_a_record_written_twice_is_found_once_and_a_line_being_written_is_skipped(tmp_path):
    sink = RecordSink(str(tmp_path), retention_s=86400)
    request_id = new_request_id("kabc")
    sink.append("w1", [record(request_id, id_time(request_id))] * 2)
    assert sink.find(request_id)["id"] == request_id
    other = new_request_id("kabc")
    [path] = tmp_path.rglob("w1.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps(record(other, id_time(other)))[:40])  # cut short: no newline yet
    assert sink.find(other) is None


def test_an_x_request_id_names_the_first_request_that_used_it_or_the_keys_last(tmp_path):
    sink = RecordSink(str(tmp_path), retention_s=86400)
    at = 1_790_000_000_000
    sink.append(
        "w1",
        [
            record("ka-1", at, http_request_id="client-7"),
            record("kb-1", at + HOUR_MS, http_request_id="client-7"),
            record("ka-2", at + 2 * HOUR_MS, http_request_id="client-7"),
        ],
    )
    assert sink.find(http_request_id="client-7")["id"] == "ka-1"
    assert sink.find(http_request_id="client-7", key_id="ka")["id"] == "ka-2"
    assert sink.find(http_request_id="client-7", key_id="kc") is None
    assert sink.find(http_request_id="client-8") is None


def test_days_past_the_retention_are_removed_whole(tmp_path):
    sink = RecordSink(str(tmp_path), retention_s=2 * 86400)
    now_ms = 1_790_000_000_000
    for days in (0, 1, 2, 3, 5):
        sink.append("w1", [record(f"ka-{days}", now_ms - days * 24 * HOUR_MS)])
    (tmp_path / "notes").mkdir()  # not a day: left alone
    assert sink.sweep(now_ms / 1000) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["20260919", "20260920", "20260921", "notes"]
    assert RecordSink(str(tmp_path / "none"), 60).sweep(time.time()) == 0


def test_a_batch_the_full_disk_refuses_in_its_second_hour_leaves_no_hour_written(tmp_path):
    """A batch of records spanning two hours, the second past what the disk holds: the
    first hour's file is taken back too, so the retry writes the batch once, whole."""
    with small_disk(tmp_path / "sink", "64k") as disk:
        sink = RecordSink(str(disk), retention_s=86400)
        at = 1_790_000_000_000
        sink.append("w1", [record("ka-0", at)])
        kept = {path: path.read_bytes() for path in disk.rglob("*.jsonl")}
        batch = [record("ka-1", at), record("ka-2", at + HOUR_MS, pad="x" * (200 << 10))]
        with pytest.raises(OSError):
            sink.append("w1", batch)
        assert {path: path.read_bytes() for path in disk.rglob("*.jsonl")} == {
            **kept,
            **{path: b"" for path in disk.rglob("*.jsonl") if path not in kept},
        }
        sink.append("w1", batch[:1])
        assert [
            json.loads(line)["id"] for path in sorted(disk.rglob("*.jsonl")) for line in path.read_text().splitlines()
        ] == ["ka-0", "ka-1"]
