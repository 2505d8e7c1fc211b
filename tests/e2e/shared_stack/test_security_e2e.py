"""The gateway tried as a hostile client would, on the real stack (Redis, Ray
Serve, the vLLM CPU engines of the local config, an admin token set):

- every shape of media URL vLLM reads is refused before a replica sees it, and
  a listener on 127.0.0.1 proves no connection is ever opened;
- 10,000 random bearer tokens leave the ingress' memory within a bound;
- a 100 MiB chunked upload is refused with 413 before it is read;
- deep JSON, huge numbers, invalid UTF-8, odd headers → an OpenAI 4xx, never 500;
- Serve's control headers are refused (no generation runs for them);
- every route that serves a model's data refuses a key not allowed that model
  (walked from the ingress' route table, dialects included);
- /health and /ready answer without a key and name no model.
"""

from __future__ import annotations

import collections
import json
import select
import socket
import threading
import time
import uuid

import httpx
import psutil
import pytest
from http_checks import Listener, assert_error_envelope
from stack import call_replica, create_key

from serve_app.http.ingress import ROUTE_ACCESS
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
UPLOAD_BYTES = 100 * 1024 * 1024
# The process-level check; the cache's exact bound (3,000 tokens leave <= 1,000
# entries) is tests/integration/test_quota_hardening.py::test_random_bearer_tokens_leave_the_key_cache_bounded.
RANDOM_TOKENS = 3_000
INGRESS_GROWTH_BOUND = 16 * 1024 * 1024  # RSS growth allowed for RANDOM_TOKENS bad tokens


def chat(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


# -- media URLs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listener():
    server = Listener()
    yield server
    server.close()


def media_parts(url):
    """Each shape vLLM 0.32 reads a media URL from (renderers/chat_utils.py)."""
    return {
        "image_url": {"type": "image_url", "image_url": {"url": url}},
        "image_url string": {"type": "image_url", "image_url": url},
        "input_image": {"type": "input_image", "image_url": url},
        "untyped image_url": {"image_url": url},
        "untyped audio_url dict": {"audio_url": {"url": url}},
        "uuid + image_url": {"type": "image_url", "image_url": {"url": url}, "uuid": "u1"},
        "uuid + untyped video_url": {"uuid": "u2", "video_url": url},
        "video_url": {"type": "video_url", "video_url": {"url": url}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": url}},
    }


@pytest.mark.parametrize("shape", list(media_parts("x")))
def test_no_media_url_shape_reaches_a_replica(base_url, api_key, listener, shape):
    headers = {"authorization": f"Bearer {api_key}"}
    for url in (f"http://127.0.0.1:{listener.port}/latest/meta-data/", f"http://localhost:{listener.port}/x.png"):
        part = media_parts(url)[shape]
        for path, body in (
            ("/v1/chat/completions", chat([{"type": "text", "text": "hi"}, part])),
            ("/v1/embeddings", {"model": "minilm", "input": "x", "messages": [{"role": "user", "content": [part]}]}),
            ("/invocations", chat([part])),  # SageMaker's route
        ):
            response = httpx.post(base_url + path, json=body, headers=headers, timeout=60)
            error = assert_error_envelope(response, 400)
            assert error["code"] == "media_url_not_allowed", (path, error)
    time.sleep(0.5)
    assert listener.connections == 0


# -- memory, size and parsing -----------------------------------------------------------


def ingress_processes() -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["cmdline"]) if "ServeReplica:llm:Ingress" in " ".join(p.info["cmdline"] or [])
    ]


def test_random_bearer_tokens_leave_the_ingress_memory_bounded(base_url):
    answers: list[tuple[int, str | None]] = []

    def flood(count):
        with httpx.Client(base_url=base_url, timeout=30) as http:
            for _ in range(count):
                response = http.get("/v1/models", headers={"authorization": f"Bearer sk-{uuid.uuid4().hex}"})
                code = response.json()["error"]["code"] if response.status_code >= 400 else None
                answers.append((response.status_code, code))

    def flood_in_parallel(count, threads=4):
        workers = [threading.Thread(target=flood, args=(count // threads,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    (ingress,) = ingress_processes()
    flood_in_parallel(1_200)  # warm: allocator arenas, the bounded caches (1,000 refused tokens) filled
    before = ingress.memory_info().rss
    flood_in_parallel(RANDOM_TOKENS)
    grown = ingress.memory_info().rss - before
    print(f"ingress RSS after {RANDOM_TOKENS} random tokens: {grown / 2**20:+.1f} MiB")
    assert grown < INGRESS_GROWTH_BOUND, grown
    # Every token is refused: 401, or, when this loaded box delays Redis past the
    # lookup timeout, the 503 that says the key could not be checked (never a 200).
    refused = collections.Counter(answers)
    assert set(refused) <= {(401, "invalid_api_key"), (503, "quota_backend_unavailable")}, refused
    assert refused[(401, "invalid_api_key")] >= 0.9 * len(answers), refused


def test_a_chunked_upload_past_the_limit_is_refused_before_it_is_read(base_url, api_key):
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b"a" * (1024 * 1024)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent, answer = 0, b""
    sock.settimeout(2)
    try:
        while sent < UPLOAD_BYTES and not answer:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                answer = sock.recv(65536)
                break
            try:
                sock.sendall(framed)  # blocks once the server stops reading
                sent += len(chunk)
            except TimeoutError:  # the server stopped reading: its answer is next
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    if not answer:
        sock.settimeout(10)
        answer = sock.recv(65536)
    sock.close()
    print(f"chunked upload: refused after {sent / 2**20:.0f} MiB sent")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # Refused while arriving: the 413 came back before the client had sent it all
    # (what was sent past the 8 MiB the ingress read sat in socket and proxy buffers).
    assert sent < UPLOAD_BYTES


def raw_post(base_url: str, path: str, headers: dict[str, str], declared: int, send) -> tuple[bytes, int, float]:
    """POST ``path`` declaring ``declared`` bytes, its body sent by ``send(sock)`` until the
    server answers; (the answer's first bytes, bytes sent, seconds to the answer)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=120)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    started = time.monotonic()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {declared}\r\n{head}\r\n".encode())
    sent = send(sock)
    sock.settimeout(120)
    try:
        answer = sock.recv(65536)
    except (ConnectionResetError, TimeoutError):
        answer = b""
    sock.close()
    return answer, sent, time.monotonic() - started


def test_a_form_past_the_consoles_bound_is_refused_before_it_is_read(base_url):
    """The console's login took a 256 MiB form whole before its 413 (its replica grew by
    250 MiB): its route now declares a form's bound (16 KiB), and a declared 64 MiB gets
    its 413 before a byte of it is read; one sent without its length is cut at the bound."""
    form = {"content-type": "application/x-www-form-urlencoded", "origin": base_url}

    def flood(sock) -> int:
        sent, chunk = 0, b"credential=" + b"a" * (1 << 20)
        sock.settimeout(2)
        try:
            while sent < 64 << 20:
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(chunk)
                sent += len(chunk)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        return sent

    answer, sent, _ = raw_post(base_url, "/console/login", form, 64 << 20, flood)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 64 << 20


def test_a_body_trickling_in_is_cut_off_at_its_deadline_on_the_console_and_the_api(base_url, api_key):
    """A body sent a byte every 2 s stayed open past 100 s on the console's login: the
    route's deadline (``ingress.body_timeout_s``, 60 s) now ends it with a 408, on the
    console and on an API route the ingress reads (``/v1/batches``), both at once."""

    def trickle(sock) -> int:
        sent = 0
        sock.settimeout(2.5)
        try:
            for _ in range(60):  # 120 s at most: past the deadline
                if select.select([sock], [], [], 2)[0]:
                    break
                sock.sendall(b"a")
                sent += 1
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        return sent

    calls = {
        "console": ("/console/login", {"content-type": "application/x-www-form-urlencoded", "origin": base_url}),
        "api": ("/v1/batches", {"content-type": "application/json", "authorization": f"Bearer {api_key}"}),
    }
    answers: dict[str, tuple] = {}
    threads = [
        threading.Thread(target=lambda n=name, c=call: answers.__setitem__(n, raw_post(base_url, *c, 1000, trickle)))
        for name, call in calls.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    for name, (answer, sent, seconds) in answers.items():
        print(f"{name}: {answer[:12]!r} after {seconds:.0f} s, {sent} bytes sent")
        assert answer.startswith(b"HTTP/1.1 408"), (name, answer[:300])
        assert 30 < seconds < 90 and sent < 1000, (name, seconds, sent)  # the 60 s deadline, not a proxy's
    assert set(answers) == set(calls)


NOT_FOUND = "does not exist or you do not have access to it"

HOSTILE_BODIES = {
    "100,000 [": b"[" * 100_000,
    "deep object": b'{"model": "tiny-llama", "messages": ' + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}",
    "huge integer": b'{"model": "tiny-llama", "messages": [], "max_tokens": ' + b"9" * 100_000 + b"}",
    "huge max_tokens": json.dumps(chat("hi", max_tokens=10**30)).encode(),
    "float infinity": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    "NaN": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
    "invalid UTF-8": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    "nul bytes": b'{"model": "tiny\x00llama", "messages": [{"role": "user", "content": "\x00"}]}',
    "lone surrogate": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/invocations",
        "/serving-endpoints/tiny-llama/invocations",
        "/chat/completions",
        "/v1/messages",
        "/rerank",
        "/tokenize",
    ],
)
def test_hostile_bodies_get_a_4xx_never_a_500(base_url, api_key, name, path):
    response = httpx.post(
        base_url + path,
        content=HOSTILE_BODIES[name],
        timeout=60,
        headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text


@pytest.mark.parametrize(
    "header, value",
    [
        ("authorization", b"Bearer \xff\xfe\xc3\x28"),
        ("authorization", b"Bearer " + "ключ".encode()),
        ("api-key", b"\x80" * 5000),
        ("x-api-key", b"\xff" * 100),
        ("authorization", b"Basic Zm9vOmJhcg=="),
        ("authorization", b"Bearer"),
    ],
)
def test_odd_key_headers_are_a_401(base_url, header, value):
    response = httpx.post(base_url + "/v1/chat/completions", json=chat("hi"), headers=[(header.encode(), value)])
    assert_error_envelope(response, 401)


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer " + "адмін".encode(), b"Bearer " + b"\xe9" * 10_000])
def test_odd_admin_token_headers_are_a_401(base_url, admin_token, value):
    response = httpx.get(base_url + "/admin/keys", headers=[(b"authorization", value)])
    assert_error_envelope(response, 401)
    assert httpx.get(base_url + "/admin/keys", headers={"authorization": f"Bearer {admin_token}"}).status_code == 200


def test_a_named_admin_made_with_the_bootstrap_token_acts_under_its_own_name_until_revoked(base_url, admin_token):
    boot = {"authorization": f"Bearer {admin_token}"}
    name = f"ops-{uuid.uuid4().hex[:8]}@example.com"
    made = httpx.post(base_url + "/admin/admins", json={"name": name}, headers=boot, timeout=30)
    assert made.status_code == 201 and made.json()["created_by"] == "admin-token"
    mine = {"authorization": f"Bearer {made.json()['secret']}"}
    assert_error_envelope(httpx.post(base_url + "/admin/admins", json={"name": name}, headers=boot, timeout=30), 409)
    for bad in ({"name": "a b"}, {"name": ["x"]}, {"name": "x" * 65}, {}, {"name": "ok", "extra": 1}):
        assert_error_envelope(httpx.post(base_url + "/admin/admins", json=bad, headers=boot, timeout=30), 400)
    created = httpx.post(base_url + "/admin/keys", json={"name": f"by-{name}"}, headers=mine, timeout=30)
    assert created.status_code == 201
    key = created.json()
    trail = httpx.get(base_url + "/admin/audit", params={"target": key["id"]}, headers=mine, timeout=30).json()
    assert [(e["action"], e["actor"]) for e in trail["data"]] == [("key.create", f"admin:{name}")]
    # An admin credential is no API key, and an API key no admin credential.
    assert_error_envelope(httpx.post(base_url + "/v1/chat/completions", json=chat("hi"), headers=mine, timeout=30), 401)
    assert_error_envelope(
        httpx.get(base_url + "/admin/keys", headers={"authorization": f"Bearer {key['secret']}"}, timeout=30), 401
    )
    assert httpx.delete(base_url + f"/admin/admins/{name}", headers=boot, timeout=30).status_code == 200
    assert_error_envelope(httpx.get(base_url + "/admin/keys", headers=mine, timeout=30), 401)  # at once
    listed = httpx.get(base_url + "/admin/admins", headers=boot, timeout=30).json()["data"]
    assert name not in [a["name"] for a in listed] and "secret" not in json.dumps(listed)


# -- Serve's control headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "header, value",
    [
        ("x-request-disconnect-disabled", "?1"),
        ("X-Request-Timeout-Seconds", "0"),
        ("x-request-timeout-seconds", "86400"),
        # Which adapter a replica runs, in place of the one the body named and the key
        # was authorized for (before: the header's won on the direct route).
        ("serve-multiplexed-model-id", "another-adapter"),
        ("serve_multiplexed_model_id", "another-adapter"),
    ],
)
def test_serve_control_headers_are_refused_before_any_generation(base_url, redis_server, redis, header, value):
    key_id, secret = create_key(redis_server.url, f"control-{uuid.uuid4().hex[:6]}")
    body = chat("Tell me a story.", max_tokens=1500, ignore_eos=True, stream=True)
    with httpx.Client(base_url=base_url, timeout=30) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}", header: value}
        ) as response:
            response.read()
            error = assert_error_envelope(response, 400)
    assert error["code"] == "header_not_allowed" and error["param"] == header.lower()
    load = call_replica(MODEL, "engine_load")
    assert load["unfinished"] == 0 and load["running"] == 0, load
    assert not list(redis.scan_iter(match=redis_names.request_record_prefix(key_id) + "*"))


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat("Tell me a story.", max_tokens=1500, use_beam_search=True, n=4)),  # one hop
        ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "use_beam_search": True}),
        ("/v3/chat/completions", chat("Tell me a story.", max_tokens=1500, use_beam_search=True)),  # the ingress
    ],
)
def test_beam_search_is_refused_before_any_generation(base_url, redis_server, redis, path, body):
    """vLLM's beam search drops the tier's priority and runs width x n sequences the
    reservation does not price (serve_app/wire/parameters.py): a 400 naming it, and
    nothing generated or charged, on the one hop and through the ingress."""
    key_id, secret = create_key(redis_server.url, f"beams-{uuid.uuid4().hex[:6]}")
    response = httpx.post(base_url + path, json=body, headers={"authorization": f"Bearer {secret}"}, timeout=60)
    error = assert_error_envelope(response, 400)
    assert error["code"] == "unsupported_parameter" and error["param"] == "use_beam_search", error
    load = call_replica(MODEL, "engine_load")
    assert load["unfinished"] == 0 and load["running"] == 0, load
    assert not list(redis.scan_iter(match=redis_names.request_record_prefix(key_id) + "*"))


# -- authorization, route by route --------------------------------------------------------


def forbidden_model_probes(base_url):
    """One request per "key" route of the ingress' table, each for MODEL."""
    chat_body, completion = chat("hi"), {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    embedding = {"model": MODEL, "input": "hi"}
    azure = {"azureml-model-deployment": MODEL}
    probes = {}
    for prefix in ("/v1/", "/v3/", "/serving-endpoints/"):
        probes[("POST", prefix + "chat/completions")] = ("POST", prefix + "chat/completions", chat_body, {})
        probes[("POST", prefix + "completions")] = ("POST", prefix + "completions", completion, {})
        probes[("POST", prefix + "embeddings")] = ("POST", prefix + "embeddings", embedding, {})
    for prefix in ("/v1/", "/v3/"):
        probes[("GET", prefix + "models/{model_id:path}")] = ("GET", prefix + "models/" + MODEL, None, {})
    for prefix in ("/", "/models/"):
        probes[("POST", prefix + "chat/completions")] = ("POST", prefix + "chat/completions", chat_body, {})
        probes[("POST", prefix + "embeddings")] = ("POST", prefix + "embeddings", {"input": ["hi"]}, azure)
    probes[("GET", "/info")] = ("GET", "/info", None, azure)
    probes[("GET", "/models/info")] = ("GET", "/models/info", None, azure)
    probes[("POST", "/invocations")] = ("POST", "/invocations", {"inputs": "hi", "parameters": {}}, {})
    probes[("POST", "/serving-endpoints/{name}/invocations")] = (
        "POST",
        f"/serving-endpoints/{MODEL}/invocations",
        {"prompt": "hi", "max_tokens": 2},
        {},
    )
    probes[("POST", "/v1/responses")] = (
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False},
        {},
    )
    probes[("POST", "/v1/messages")] = (
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        {},
    )
    probes[("POST", "/v1/messages/count_tokens")] = (
        "POST",
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        {},
    )
    for path in ("/score", "/v1/score"):
        probes[("POST", path)] = ("POST", path, {"model": MODEL, "queries": "a", "documents": ["b"]}, {})
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        probes[("POST", path)] = ("POST", path, {"model": MODEL, "query": "a", "documents": ["b"]}, {})
    probes[("POST", "/tokenize")] = ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}, {})
    probes[("POST", "/detokenize")] = ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}, {})
    return probes


def test_no_route_serves_a_model_to_a_key_not_allowed_it(base_url, redis_server):
    key_routes = {route for route, kind in ROUTE_ACCESS.items() if kind == "key"}
    probes = forbidden_model_probes(base_url)
    listing = {("GET", "/v1/models"), ("GET", "/v3/models")}
    # A key's own stored responses: they name no model; another key's id is not found.
    stored = {
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("GET", "/v1/responses/{response_id}/input_items"),
    }
    # Files and batches: a key's own too, named by no model (a batch's requests are
    # authorized one by one as they run: tests/e2e/quota_stack/test_1_batches_e2e.py).
    files_and_batches = {route for route in key_routes if route[1].startswith(("/v1/files", "/v1/batches"))}
    assert len(files_and_batches) == 9
    assert set(probes) | listing | stored | files_and_batches == key_routes  # a new route needs its probe here

    _, secret = create_key(redis_server.url, "other-models-only", models=["some-other-model"])
    _, allowed = create_key(redis_server.url, "this-model", models=[MODEL])
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for route, (method, path, body, headers) in probes.items():
            for key, expect in ((secret, {404, 400}), (None, {401})):
                auth = {"authorization": f"Bearer {key}"} if key else {}
                response = http.request(method, path, json=body, headers={**headers, **auth})
                assert response.status_code in expect, (route, response.status_code, response.text[:300])
                if key:  # the answer of a model that does not exist (or of an endpoint that serves none)
                    assert NOT_FOUND in response.text or "serves no model" in response.text, (route, response.text)
            # The control: the same probe with a key allowed the model is not refused for it.
            response = http.request(method, path, json=body, headers={**headers, "authorization": f"Bearer {allowed}"})
            assert response.status_code != 401 and NOT_FOUND not in response.text, (route, response.text[:300])
        for path in sorted(p for _, p in listing):
            response = http.get(path, headers={"authorization": f"Bearer {secret}"})
            assert response.status_code == 200 and response.json()["data"] == [], response.text
        kept = http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "canary 7f3e", "max_output_tokens": 2},
            headers={"authorization": f"Bearer {allowed}"},
        )
        assert kept.status_code == 200, kept.text
        for method, route in sorted(stored):
            path = route.replace("{response_id}", kept.json()["id"])
            for key, expect in ((secret, 404), (None, 401)):
                auth = {"authorization": f"Bearer {key}"} if key else {}
                response = http.request(method, path, headers=auth)
                assert response.status_code == expect, (route, response.status_code, response.text[:300])
                assert "canary" not in response.text, response.text
        _files_and_batches_are_their_keys_own(http, files_and_batches, secret, allowed)


def _files_and_batches_are_their_keys_own(http: httpx.Client, routes, other: str, owner: str) -> None:
    """Each file and batch route, called by another key for the owner's file and
    batch (404; nothing of the file, its name or content, in any answer: the 404
    echoes only the id asked for) and with no key (401)."""
    line = {
        "custom_id": "canary-91c4",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "canary 91c4"}], "max_tokens": 2},
    }
    own = {"authorization": f"Bearer {owner}"}
    file = http.post(
        "/v1/files",
        headers=own,
        data={"purpose": "batch"},
        files={"file": ("canary.jsonl", json.dumps(line).encode() + b"\n")},
    )
    assert file.status_code == 200, file.text
    batch = http.post(
        "/v1/batches",
        headers=own,
        json={"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    for method, route in sorted(routes):
        path = route.replace("{file_id}", file.json()["id"]).replace("{batch_id}", batch.json()["id"])
        body = {"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        for key, expect in (
            (other, {404} if "{" in route or route == "/v1/batches" and method == "POST" else {200, 400}),
            (None, {401}),
        ):
            auth = {"authorization": f"Bearer {key}"} if key else {}
            response = http.request(method, path, headers=auth, json=body if method == "POST" else None)
            assert response.status_code in expect, (method, route, response.status_code, response.text[:300])
            assert "canary" not in response.text, response.text  # neither its name nor its content


# -- probes ---------------------------------------------------------------------------------


def test_probes_answer_without_a_key_and_name_no_model(base_url):
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    ready = httpx.get(base_url + "/ready")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "models_ready": 3, "models": 3}  # the local config's two, the reranker
    assert httpx.get(base_url + "/ping").status_code == 200
    for hidden in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(base_url + hidden).status_code == 404
    # Ray's HAProxy lists every application's route on /-/routes (each direct-route model by
    # name) to anyone: the edge answers it as an unknown URL, in the envelope, naming none.
    for spelling in ("/-/routes", "/-/ROUTES"):
        listing = httpx.get(base_url + spelling)
        assert listing.status_code == 404 and listing.json()["error"]["code"] == "unknown_url", listing.text
        assert "tiny-llama" not in listing.text and "minilm" not in listing.text
