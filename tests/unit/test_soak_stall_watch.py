"""The soak's watch for replicas the Serve controller loses touch with (soak/stall_watch.py):
it reads the controller's log as it grows, acts once per replica, finds the replica's
process through Ray and dumps its threads, or says why it could not."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from soak import stall_watch
from soak.stall_watch import StallWatch

LINE = (
    "WARNING deployment_state.py:1705 - Didn't receive health check response for replica "
    "Replica(id='abc123', deployment='model-paced-direct', app='direct-paced-direct') after 30s, "
    "marking it unhealthy.\n"
)


def watch(tmp_path, ray_cli):
    logs = tmp_path / "logs"
    (logs / "serve").mkdir(parents=True)
    return StallWatch(tmp_path, ray_cli, logs), logs / "serve" / "controller_1.log"


def test_a_replica_is_acted_on_once_and_one_gone_is_said_so(tmp_path):
    asked = []

    def ray_cli(*args):
        asked.append(args)
        raise AssertionError("no such actor")

    watcher, log = watch(tmp_path, ray_cli)
    log.write_text("INFO all fine\n" + LINE)
    [found] = watcher._new_stalls()
    assert (found["id"], found["app"], found[1]) == ("abc123", "direct-paced-direct", "health check")
    watcher._dump(found)
    assert "SERVE_REPLICA::direct-paced-direct#model-paced-direct#abc123" in " ".join(asked[0])
    assert "no process found" in watcher.caught[0]
    with log.open("a") as more:
        more.write(LINE.replace("health check", "routing stats"))
    assert watcher._new_stalls() == []  # the same replica again: once is enough


@pytest.mark.skipif(not (stall_watch.BIN / "py-spy").exists(), reason="py-spy comes with the bench extra")
def test_a_stalled_replicas_threads_are_dumped(tmp_path, monkeypatch):
    monkeypatch.setattr(stall_watch, "DUMPS", 1)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        watcher, log = watch(tmp_path, lambda *_: json.dumps([{"pid": sleeper.pid}]))
        log.write_text(LINE)
        watcher.start()
        deadline = time.monotonic() + 30
        while not watcher.caught and time.monotonic() < deadline:
            time.sleep(0.2)
        watcher.stop()
    finally:
        sleeper.kill()
    assert f"pid {sleeper.pid}" in watcher.caught[0]
    assert (
        "time.sleep" in (tmp_path / "stalls" / f"abc123-{sleeper.pid}.txt").read_text()
        or "sleep" in (tmp_path / "stalls" / f"abc123-{sleeper.pid}.txt").read_text()
    )
