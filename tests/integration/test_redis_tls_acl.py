"""A Redis that speaks TLS only to an ACL user, as managed services run it: the
gateway admits through it with a ``rediss://user:password@`` URL, and a wrong
password is a 503 ``quota_backend_error``, never a fail-open admission."""

from __future__ import annotations

import subprocess

import pytest

from contract.replica_wire import Usage
from http_checks import free_port
from redis_server import RedisServer
from serve_app.access import Access
from serve_app.errors import OpenAIError
from serve_app.keys import KeyLimits, KeyStore
from serve_app.redis_client import connect
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

PASSWORD = "s3cret-acl"


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """(URL with the right password, URL with a wrong one)."""
    certs = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=test-ca", cwd=certs)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1", cwd=certs)
    (certs / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "1", "-extfile", "san.cnf", cwd=certs)
    server, tls_port = RedisServer(), free_port()
    # The plain port stays on loopback for the harness' readiness check only.
    server.start(["--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
                  "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
                  "--tls-auth-clients", "no", "--user", "app", "on", f">{PASSWORD}", "~*", "&*", "+@all",
                  "--user", "default", "off"])
    query = f"?ssl_ca_certs={certs / 'ca.crt'}"
    try:
        yield (f"rediss://app:{PASSWORD}@127.0.0.1:{tls_port}/0{query}",
               f"rediss://app:wrong@127.0.0.1:{tls_port}/0{query}")
    finally:
        server.stop()


def gate(url: str) -> Access:
    return Access(AppSettings(redis_url=url, quota={"fail_mode": "open", "redis_timeout_s": 2}),
                  Telemetry(False, False))


async def test_admission_over_tls_as_an_acl_user(tls_redis):
    url, _ = tls_redis
    access = gate(url)
    try:
        _, secret = await KeyStore(access.redis).create("tls-team", KeyLimits(requests_per_minute=10))
        key = await access.authenticate({"authorization": f"Bearer {secret}"})
        ticket = await access.admit(key, "m", 10)
        assert not ticket.local  # decided by Redis, over TLS
        access.settle(ticket, "completed", Usage(prompt_tokens=3, completion_tokens=4))
    finally:
        await access.redis.aclose()


async def test_a_wrong_password_is_a_backend_error_not_an_outage(tls_redis):
    url, wrong = tls_redis
    client = connect(url)
    try:
        _, secret = await KeyStore(client).create("tls-wrong", KeyLimits(requests_per_minute=10))
        record = await KeyStore(client).resolve("tls-wrong")
    finally:
        await client.aclose()
    access = gate(wrong)  # fail_mode open: an outage would be admitted on local limits
    try:
        for attempt in (access.authenticate({"authorization": f"Bearer {secret}"}), access.admit(record, "m", 10)):
            with pytest.raises(OpenAIError) as refused:
                await attempt
            assert (refused.value.status, refused.value.code) == (503, "quota_backend_error")
        assert not access.local._keys  # nothing was decided on local limits
    finally:
        await access.redis.aclose()
