"""Catches a replica that stops answering Serve's controller while the soak runs.

Run 9 of the 30-minute soak (docs/operating.md) lost a direct-route replica that kept
answering HTTP while the controller's health checks and routing-stats calls to it went
unanswered for 90 s, so Serve replaced it; what the replica was doing then was not
seen. This watches the controller's log for those timeouts and, at the first for a
replica, asks Ray for the replica's process and takes ``DUMPS`` of its Python threads
with py-spy (the event loop, Serve's user-code thread pool, Ray's threads), a few
seconds apart, into ``<run folder>/stalls/``: what the next stall was waiting on.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from soak.topology import BIN

# Serve's controller (ray/serve/_private/deployment_state.py) when a call to a replica times out.
STALLED = re.compile(
    r"Didn't receive (health check|routing stats) response for replica "
    r"Replica\(id='(?P<id>[^']+)', deployment='(?P<deployment>[^']+)', app='(?P<app>[^']+)'\)"
)
DUMPS, DUMP_GAP_S, POLL_S = 3, 3.0, 2.0


class StallWatch:
    """``ray_cli(*args) -> stdout``: the twin's ``ray`` command (topology.Twin.cli)."""

    def __init__(self, folder: Path, ray_cli: Callable[..., str], logs: Path = Path("/tmp/ray/session_latest/logs")):
        self.folder, self.ray_cli, self.logs = folder / "stalls", ray_cli, logs
        self._offsets: dict[Path, int] = {}
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self.caught: list[str] = []  # "<time> <what> <replica>: <dump file or why none>"

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(60)
        return self.caught

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            for stalled in self._new_stalls():
                self._dump(stalled)

    def _new_stalls(self) -> list[re.Match]:
        found = []
        for log in sorted((self.logs / "serve").glob("controller_*.log")):
            try:
                with log.open("rb") as handle:
                    handle.seek(self._offsets.get(log, 0))
                    text = handle.read().decode("utf-8", "replace")
                    self._offsets[log] = handle.tell()
            except OSError:
                continue
            found += [m for m in STALLED.finditer(text) if m["id"] not in self._seen]
            self._seen |= {m["id"] for m in found}
        return found

    def _dump(self, stalled: re.Match) -> None:
        when = time.strftime("%H:%M:%S")
        what = f"{when} {stalled[1]} {stalled['app']}/{stalled['deployment']}#{stalled['id']}"
        try:
            name = f"SERVE_REPLICA::{stalled['app']}#{stalled['deployment']}#{stalled['id']}"
            actors = json.loads(
                self.ray_cli("ray", "list", "actors", "--filter", f"name={name}", "--detail", "--format=json")
            )
            pid = int(actors[0]["pid"])
        except Exception as exc:  # the replica may be gone already
            self.caught.append(f"{what}: no process found ({type(exc).__name__}: {str(exc)[:200]})")
            return
        if not (BIN / "py-spy").exists():
            self.caught.append(f"{what}: pid {pid}, no py-spy to dump it (`pip install -e '.[bench]'`)")
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{stalled['id']}-{pid}.txt"
        with target.open("w") as out:
            for n in range(DUMPS):
                out.write(f"=== dump {n + 1} at {time.strftime('%H:%M:%S')} ===\n")
                out.flush()
                subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(pid)], stdout=out, stderr=out, timeout=60)
                time.sleep(DUMP_GAP_S)
        self.caught.append(f"{what}: pid {pid}, {target}")
