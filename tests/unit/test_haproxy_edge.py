"""Pure logic: the edge's settings written into Ray's HAProxy config
(cluster/haproxy_edge.py; tests/integration/test_haproxy_guard.py runs them on the
real binary)."""

import json

from cluster.haproxy_edge import EDGE_ERRORS, edge_config, error_response, rewrite_args

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
    assert "/tmp/ray/500.http" not in config and "timeout client 3600s" in defaults
    assert [line.split()[1] for line in defaults.splitlines() if "errorfile" in line] == [str(s) for s in EDGE_ERRORS]
    # A frontend stamps every request with the edge's time, first; other sections are Ray's, untouched.
    assert config.startswith("global\n    maxconn 4096\n")
    assert ("frontend http_frontend\n    http-request set-header x-llm-edge-us %[date(0,us)]\n"
            "    bind 127.0.0.1:8000\n    errorfile 503 /tmp/keep-mine.http\n") in config
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
