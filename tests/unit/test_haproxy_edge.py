"""Pure logic: the edge's settings written into Ray's HAProxy config
(cluster/haproxy_edge.py; tests/integration/test_haproxy_guard.py runs them on the
real binary)."""

import json
from pathlib import Path

import pytest

from cluster.haproxy_edge import (
    EDGE_ERRORS,
    ONE_HOP_BODY_BYTES,
    edge_config,
    edge_router_lua,
    error_response,
    rewrite_args,
)
from contract.edge import CREDENTIAL_HEADERS

RAY_CONFIG = """global
    maxconn 4096
defaults
    mode http
    timeout client 3600s
    errorfile 502 /tmp/ray/500.http
    errorfile 503 /tmp/ray/500.http
frontend http_frontend
    bind 127.0.0.1:8000
    errorfile 503 /tmp/keep-mine.http
backend llm
    timeout server 30s
"""


def test_each_defaults_section_gets_the_timeouts_and_json_errors_in_place_of_rays(tmp_path):
    config = edge_config(RAY_CONFIG, tmp_path / "errors")
    defaults = config.split("defaults\n")[1].split("frontend")[0]
    assert "timeout http-request 10s" in defaults and "timeout http-keep-alive 60s" in defaults
    assert "/tmp/ray/500.http" not in config
    # A client silent for the routes' body bound is cut (Ray's hour: a stream no one
    # reads held its slot that long); only the edge's own line is left.
    assert "timeout client 3600s" not in config and defaults.count("timeout client 60s") == 1
    assert [line.split()[1] for line in defaults.splitlines() if "errorfile" in line] == [str(s) for s in EDGE_ERRORS]
    # A frontend stamps every request with the edge's time, first; other sections are Ray's, untouched.
    assert config.startswith("global\n    maxconn 4096\n")
    assert (
        "frontend http_frontend\n    http-request set-header x-llm-edge-us %[date(0,us)]\n"
        "    http-request set-header x-llm-edge-request %[uuid()]\n"
        "    http-request deny deny_status 404 if { path -i /-/routes }\n"
        "    bind 127.0.0.1:8000\n    errorfile 503 /tmp/keep-mine.http\n"
    ) in config
    assert config.endswith("backend llm\n    timeout server 30s\n")


def test_an_error_file_is_a_whole_http_response_with_openais_envelope():
    head, _, body = error_response(503).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"Retry-After: 1" in head
    assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_the_config_haproxy_is_given_is_the_rewritten_one_beside_rays(tmp_path):
    (tmp_path / "haproxy.cfg").write_text(RAY_CONFIG)
    args = rewrite_args(["-db", "-f", str(tmp_path / "haproxy.cfg"), "-sf", "12"])
    assert args == ["-db", "-f", str(tmp_path / "haproxy.cfg.edge"), "-sf", "12"]
    assert "timeout http-request" in (tmp_path / "haproxy.cfg.edge").read_text()
    assert (tmp_path / "haproxy.cfg").read_text() == RAY_CONFIG


def _rays_router_lua() -> str:
    import ray.serve

    return (Path(ray.serve.__file__).parent / "_private" / "ingress_request_router.lua.tmpl").read_text()


def test_the_edge_routers_lua_hands_it_the_clients_credential_headers(tmp_path):
    """Ray's Lua, as the installed Ray writes it, patched where it builds the router's
    request and where it calls it; loaded in its place by the rewritten config."""
    source = _rays_router_lua()
    patched = edge_router_lua(source)
    assert "llm_credentials(hdrs)" in patched and '.. (credentials or "")' in patched
    for name in CREDENTIAL_HEADERS:
        assert f'"{name}"' in patched
    lua = tmp_path / "ingress_request_router.lua"
    lua.write_text(source)
    (tmp_path / "haproxy.cfg").write_text(f"global\n    lua-load-per-thread {lua}\n" + RAY_CONFIG.split("\n", 1)[1])
    rewrite_args(["-f", str(tmp_path / "haproxy.cfg")])
    assert f"lua-load-per-thread {lua}.edge\n" in (tmp_path / "haproxy.cfg.edge").read_text()
    assert (tmp_path / "ingress_request_router.lua.edge").read_text() == patched
    assert lua.read_text() == source


def test_a_ray_whose_lua_moved_is_refused_not_routed_around():
    source = _rays_router_lua().replace("        .. request_id_header\n", "        .. request_id_header .. x\n")
    with pytest.raises(ValueError, match="request_id_header"):
        edge_router_lua(source)


RAY_CONFIG_WITH_DIRECT_ROUTES = """global
    maxconn 4096
    tune.bufsize 16384
defaults
    mode http
frontend prometheus
    bind :9101
frontend http_frontend
    bind 127.0.0.1:8000
    acl is_direct-org--big path_beg /direct/org--big/
    acl is_direct-org--big path /direct/org--big
    acl is_direct-tiny path_beg /direct/tiny/
    acl is_direct-tiny path /direct/tiny
    acl is_llm path_beg /
    use_backend direct-tiny if is_direct-tiny
"""


# Ray declares a backend for each application it routes (the ACLs name them).
BOTH_BACKENDS = (
    "backend direct-org--big\n    server r1 10.0.0.2:8001 check\n"
    "backend direct-tiny\n    server r1 10.0.0.1:8001 check\n"
)


def test_a_frontend_routing_direct_applications_sends_their_models_v1_requests_there():
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES + BOTH_BACKENDS, Path("/tmp/unused-errors"))
    frontend = config.split("frontend http_frontend\n")[1].split("\nbackend")[0]
    rules = [line.strip() for line in frontend.splitlines() if line.strip().startswith("http-request")]
    assert rules[0].startswith("http-request set-header x-llm-edge-us")  # still first
    assert rules[1] == "http-request set-header x-llm-edge-request %[uuid()]"  # replacing any a client sent
    assert rules[2] == "http-request deny deny_status 404 if { path -i /-/routes }"  # Ray's listing: not to anyone
    assert rules[3].startswith("http-request wait-for-body time 10s if METH_POST { path /v1/chat/completions ")
    # Each route's rule holds only while one of its replicas is up: else the ingress wakes and waits for one.
    assert rules[-2:] == [
        "http-request set-path /direct/org--big%[path] if { var(txn.llm_one_hop) -m str org--big } "
        "llm_replica_up_org--big",
        "http-request set-path /direct/tiny%[path] if { var(txn.llm_one_hop) -m str tiny } llm_replica_up_tiny",
    ]
    assert "    acl llm_replica_up_tiny srv_is_up(direct-tiny/r1)\n" in frontend
    # A route with no replica in the config (scaled to zero, or not declared) gets no rule;
    # Ray's fallback proxy (a backup server) is not one of its replicas.
    config = edge_config(
        RAY_CONFIG_WITH_DIRECT_ROUTES
        + BOTH_BACKENDS.split("backend direct-tiny")[0]
        + "backend direct-tiny\n    server fallback 10.0.0.9:8000 check backup\n",
        Path("/tmp/x"),
    )
    assert "set-path /direct/org--big" in config and "/direct/tiny%" not in config and "up_tiny" not in config
    # Several replicas: up when any is (a named ACL on several lines is their "or").
    config = edge_config(
        RAY_CONFIG_WITH_DIRECT_ROUTES + BOTH_BACKENDS + "    server r2 10.0.0.3:8001 check\n", Path("/tmp/x")
    )
    assert [line.strip() for line in config.splitlines() if "acl llm_replica_up_tiny" in line] == [
        "acl llm_replica_up_tiny srv_is_up(direct-tiny/r1)",
        "acl llm_replica_up_tiny srv_is_up(direct-tiny/r2)",
    ]
    assert "set-path" not in config.split("frontend prometheus\n")[1].split("frontend")[0]
    assert f"tune.bufsize {ONE_HOP_BODY_BYTES}\n" in config and "tune.bufsize 16384" not in config


def test_without_a_direct_route_the_edge_reads_no_body():
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES.replace("/direct/", "/other/"), Path("/tmp/unused-errors"))
    assert "wait-for-body" not in config and "set-path" not in config and "tune.bufsize 16384\n" in config


RAY_DIRECT_BACKEND = """backend direct-tiny
    log global
    timeout server 60s
    option httpchk GET /-/healthz
    http-check expect status 200
    server r1 10.0.0.1:8001 check observe layer4
    server fallback 10.0.0.9:8000 check backup
"""


def test_a_direct_application_gets_a_session_backend_tracking_its_replicas(monkeypatch):
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES + RAY_DIRECT_BACKEND, Path("/tmp/unused-errors"))
    frontend = config.split("frontend http_frontend\n")[1].split("\nbackend")[0]
    uses = [line.strip() for line in frontend.splitlines() if "use_backend" in line]
    # Sessions first (after Ray's ACLs, which it names), then Ray's own rules.
    # (org--big has an ACL but no backend declared: no rule naming one.)
    assert uses == [
        "use_backend direct-tiny-session if is_direct-tiny { req.hdr(x-session-id) -m found }",
        "use_backend direct-tiny if is_direct-tiny",
    ]
    retried = RAY_DIRECT_BACKEND.replace("direct-tiny\n", "direct-tiny\n    retry-on conn-failure empty-response\n", 1)
    assert config.endswith(
        retried
        + """backend direct-tiny-session
    http-request set-var(txn.llm_session_0) req.hdr(authorization)
    http-request set-var(txn.llm_session_1) req.hdr(api-key)
    http-request set-var(txn.llm_session_2) req.hdr(x-api-key)
    http-request set-var(txn.llm_session_3) req.hdr(x-session-id)
    balance hash str(llm)"""
        + "".join(f",concat(|,txn.llm_session_{i},)" for i in range(4))
        + """
    hash-type consistent
    hash-balance-factor 150
    retry-on conn-failure empty-response
    log global
    timeout server 60s
    server r1 10.0.0.1:8001 track direct-tiny/r1
    server fallback 10.0.0.9:8000 track direct-tiny/fallback backup
"""
    )
    # Ray's setting for its session header names ours too.
    monkeypatch.setenv("RAY_SERVE_SESSION_ID_HEADER_KEY", "X-Conversation")
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES + RAY_DIRECT_BACKEND, Path("/tmp/unused-errors"))
    assert "set-var(txn.llm_session_3) req.hdr(x-conversation)" in config
    assert "{ req.hdr(x-conversation) -m found }" in config


RAY_ROUTED_DIRECT_BACKEND = (
    RAY_DIRECT_BACKEND
    + """backend direct-tiny-via-ingress-request-router
    log global
    use-server r1 if { var(txn.ingress_request_router_target) -m str "r1" }
    server r1 10.0.0.1:8001 track direct-tiny/r1
"""
)


def test_a_direct_application_with_an_edge_router_keeps_the_one_hop_but_gets_no_session_copy():
    """Its ingress request router (serve_app/http/edge_router.py) picks the replica,
    sessions included: a session rule before Ray's would bypass it."""
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES + RAY_ROUTED_DIRECT_BACKEND, Path("/tmp/unused-errors"))
    assert "-session" not in config and "balance hash" not in config
    # Its router's copy tries again elsewhere as the backend itself does.
    for backend in ("direct-tiny", "direct-tiny-via-ingress-request-router"):
        assert f"backend {backend}\n    retry-on conn-failure empty-response\n" in config
    assert "set-path /direct/tiny%[path] if { var(txn.llm_one_hop) -m str tiny } llm_replica_up_tiny" in config


def test_the_makefile_hands_the_edge_router_at_most_the_edges_own_buffer():
    """Ray's buffer for a body-reading ingress request router (8 MiB by default) would
    be every request's buffer at the edge; the Makefile keeps it at the one hop's."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert f"RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE ?= {ONE_HOP_BODY_BYTES}\n" in makefile
    assert "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY ?= 1\n" in makefile


def test_a_routes_names_are_matched_whole_or_by_beginning_a_config_line_at_most_48_at_a_time():
    adapters = [f"a{i}" for i in range(100)]
    names = {"tiny": (["tiny", "chat-default", "has space", "#comment", 'q"uote', *adapters], ["tiny:"])}
    config = edge_config(RAY_CONFIG_WITH_DIRECT_ROUTES + BOTH_BACKENDS, Path("/tmp/unused-errors"), names)
    rules = [line.strip() for line in config.splitlines() if "str(tiny)" in line]
    words = [rule.split("-m str ")[1].rstrip(" }").split() for rule in rules if "-m str" in rule]
    # What HAProxy would read otherwise than as one word is left out (it takes two hops).
    assert [len(chunk) for chunk in words] == [48, 48, 6]
    assert sum(words, []) == ["tiny", "chat-default", *adapters]
    assert rules[-1] == "http-request set-var(txn.llm_one_hop) str(tiny) if { var(txn.llm_model) -m beg tiny: }"
    # A route with no names given keeps its own name (as its prefix writes it); the path rule comes last.
    assert "str(org--big)" not in config
    assert config.split("set-path")[0].count("http-request set-var(txn.llm_one_hop)") == 1 + len(rules)


def test_a_route_whose_replicas_answer_nothing_usable_in_time_gets_no_names():
    import http.server
    import threading

    from cluster.haproxy_edge import route_names

    answers = {
        "/direct/slow/": None,
        "/direct/wrong/": b'{"names": "tiny", "beginnings": []}',
        "/direct/garbled/": "not HTTP",
        "/direct/good/": b'{"names": ["good", "alias"], "beginnings": ["good:"]}',
    }

    class Replica(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answer = next(body for prefix, body in answers.items() if self.path.startswith(prefix))
            if answer == "not HTTP":  # what a gRPC server answers: an HTTP/2 SETTINGS frame
                self.wfile.write(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00")
                return
            if answer is None:
                threading.Event().wait(2)
                answer = b"{}"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        config = "".join(
            f"frontend f\n    acl is_direct-{r} path_beg /direct/{r}/\nbackend direct-{r}\n"
            f"    server fallback {address} check backup\n    server r1 {address} check\n"
            for r in ("good", "slow", "wrong", "garbled")
        )
        assert route_names(config, timeout_s=0.3, budget_s=1.0) == {"good": (["good", "alias"], ["good:"])}
    finally:
        server.shutdown()


RAY_ADMIN_LISTENERS = """global
    stats socket /tmp/ray/haproxy.sock mode 666 level admin expose-fd listeners
defaults
    mode http
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 0.0.0.0:8000
listen stats
  bind *:8404
  stats enable
"""


def test_haproxys_own_listeners_are_private_and_its_admin_socket_is_its_users(tmp_path, monkeypatch):
    config = edge_config(RAY_ADMIN_LISTENERS, tmp_path / "errors")
    assert "stats socket /tmp/ray/haproxy.sock mode 600 level admin" in config and "666" not in config
    assert "    bind 127.0.0.1:9101\n" in config and "  bind 127.0.0.1:8404\n" in config
    assert "    bind 0.0.0.0:8000\n" in config  # the API's own listener is the operator's choice
    monkeypatch.setenv("LLM_EDGE_ADMIN_HOST", "10.0.0.7")  # a cluster node's private address
    config = edge_config(RAY_ADMIN_LISTENERS, tmp_path / "errors")
    assert "    bind 10.0.0.7:9101\n" in config and "  bind 10.0.0.7:8404\n" in config
