"""The load helpers fail on any answer but the expected one (tests/dense_prompts.py
``burst``): a 429 is the limit under test refusing; a 5xx, another 4xx, a hang or a
refused connection fails the test that sent it, instead of dying with its thread
(pytest only warns) while the test passes on the answers that came back."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import dense_prompts
import pytest
from dense_prompts import burst
from ports import free_port

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def serving(statuses: list[int]):
    """A server answering /v1/chat/completions with each status in turn (then 200)."""
    answers, lock = list(statuses), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["content-length"]))
            with lock:
                status = answers.pop(0) if answers else 200
            if status == 200:
                body = {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
                    ],
                    "usage": USAGE,
                }
            else:
                body = {"error": {"message": f"status {status}", "type": "t", "code": None, "param": None}}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server_of():
    started = []

    def start(statuses):
        started.append(serving(statuses))
        return f"http://127.0.0.1:{started[-1].server_address[1]}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_a_burst_answered_or_refused_with_429_returns_the_usage_of_the_answered(server_of):
    answered = burst(server_of([429, 429]), ["sk"], ["hi"], max_tokens=2, model="m", clients=4)
    assert [usage.total_tokens for usage in answered] == [5, 5]


@pytest.mark.parametrize("status", [503, 500, 400])
def test_a_burst_with_one_answer_that_is_neither_fails(server_of, status):
    with pytest.raises(AssertionError, match=f"1 of 4 clients failed other than with a 429.*status {status}"):
        burst(server_of([status]), ["sk"], ["hi"], max_tokens=2, model="m", clients=4)


def test_a_burst_against_nothing_listening_fails(server_of):
    with pytest.raises(AssertionError, match="4 of 4 clients failed.*APIConnectionError"):
        burst(f"http://127.0.0.1:{free_port()}", ["sk"], ["hi"], max_tokens=2, model="m", clients=4)


def test_a_burst_still_waiting_at_its_bound_fails(monkeypatch):
    silent = ThreadingHTTPServer(("127.0.0.1", free_port()), BaseHTTPRequestHandler)  # never answers: not served
    monkeypatch.setattr(dense_prompts, "BURST_TIMEOUT_S", 1)
    try:
        with pytest.raises(AssertionError, match="2 of 2 clients still unanswered after 1 s"):
            burst(f"http://127.0.0.1:{silent.server_address[1]}", ["sk"], ["hi"], max_tokens=2, model="m", clients=2)
    finally:
        silent.server_close()
