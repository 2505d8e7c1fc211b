"""Checks on raw HTTP responses shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time

import httpx


@contextlib.contextmanager
def serving_process(command: list[str], ready_url: str, timeout_s: float, **popen):
    """Run a server process until the block ends; enter once ``ready_url`` answers 200."""
    proc = subprocess.Popen(command, **popen)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"{command[0]} exited early"
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{command[0]} did not come up"
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (including `[DONE]`)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def assert_error_envelope(response: httpx.Response, status: int) -> dict:
    """OpenAI's error envelope with exactly its four fields; returns ``error``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it is offered
    (proof that nothing tried to fetch from it)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()
