"""A private, real redis-server for a test module (stoppable, for outage tests)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time


class RedisServer:
    def __init__(self, persistent: bool = False):
        """``persistent``: keep data across stop/start (append-only file), for outage tests."""
        self.persistent = persistent
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make test installs it)"
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
             "--save", "", "--appendonly", "yes" if self.persistent else "no",
             "--appendfsync", "always"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_redis(persistent: bool = False):
    """A started RedisServer for the length of the block (fixtures wrap this)."""
    server = RedisServer(persistent=persistent)
    server.start()
    try:
        yield server
    finally:
        server.stop()
