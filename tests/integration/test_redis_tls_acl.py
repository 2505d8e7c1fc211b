"""A Redis that speaks TLS only to an ACL user, as managed services run it: the
gateway admits through it with a ``rediss://user:password@`` URL (one node) and a
``rediss+cluster://user:password@`` URL (a Redis Cluster whose bus and clients
speak TLS, as ElastiCache with in-transit encryption runs it), and a wrong
password is a 503 ``quota_backend_error``, never a fail-open admission."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
from ports import free_port
from redis_server import RedisServer

from contract.replica_wire import Usage
from serve_app.admission.seam import Refusal, Ticket
from serve_app.errors import OpenAIError
from serve_app.http.services import QuotaServices, build_quota_services
from serve_app.identity.keys import KeyStore
from serve_app.limits import KeyLimits
from serve_app.redis_store.redis_client import connect
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

PASSWORD = "s3cret-acl"


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1 (the folder holding them)."""
    certs = tmp_path_factory.mktemp("tls")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=certs,
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=certs,
    )
    (certs / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        cwd=certs,
    )
    return certs


def tls_only_to_app(certs, tls_port: int) -> list[str]:
    """redis-server arguments: TLS on ``tls_port`` (the plain port stays on loopback
    for the harness' readiness check only), user ``app`` only, the default user off."""
    return [
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(certs / "server.crt"),
        "--tls-key-file",
        str(certs / "server.key"),
        "--tls-ca-cert-file",
        str(certs / "ca.crt"),
        "--tls-auth-clients",
        "no",
        "--user",
        "app",
        "on",
        f">{PASSWORD}",
        "~*",
        "&*",
        "+@all",
        "--user",
        "default",
        "off",
    ]


@pytest.fixture(scope="module")
def tls_redis(certs):
    """(URL with the right password, URL with a wrong one)."""
    server, tls_port = RedisServer(), free_port()
    server.start(tls_only_to_app(certs, tls_port))
    query = f"?ssl_ca_certs={certs / 'ca.crt'}"
    try:
        yield (
            f"rediss://app:{PASSWORD}@127.0.0.1:{tls_port}/0{query}",
            f"rediss://app:wrong@127.0.0.1:{tls_port}/0{query}",
        )
    finally:
        server.stop()


def services(url: str) -> QuotaServices:
    return build_quota_services(
        AppSettings(redis_url=url, quota={"fail_mode": "open", "redis_timeout_s": 2}), Telemetry(False, False)
    )


async def test_admission_over_tls_as_an_acl_user(tls_redis):
    url, _ = tls_redis
    access = services(url)
    try:
        _, secret = await KeyStore(access.redis).create("tls-team", KeyLimits(requests_per_minute=10))
        key = await access.authenticator.authenticate({"authorization": f"Bearer {secret}"})
        ticket = await access.gate.admit(key, "m", 10)
        assert not ticket.local  # decided by Redis, over TLS
        access.gate.settle(ticket, "completed", Usage(prompt_tokens=3, completion_tokens=4))
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
    access = services(wrong)  # fail_mode open: an outage would be admitted on local limits
    try:
        for attempt in (
            access.authenticator.authenticate({"authorization": f"Bearer {secret}"}),
            access.gate.admit(record, "m", 10),
        ):
            with pytest.raises(OpenAIError) as refused:
                await attempt
            assert (refused.value.status, refused.value.code) == (503, "quota_backend_error")
        assert not access.gate.local._keys  # nothing was decided on local limits
    finally:
        await access.redis.aclose()


@pytest.fixture(scope="module")
def tls_cluster(certs):
    """3 primaries speaking TLS only, to clients and on the cluster bus, to user
    ``app`` only: (URL with the right password, URL with a wrong one)."""
    nodes = [RedisServer() for _ in range(3)]
    tls_ports = [free_port() for _ in nodes]
    try:
        for node, tls_port in zip(nodes, tls_ports):
            node.start(
                [
                    *tls_only_to_app(certs, tls_port),
                    "--tls-cluster",
                    "yes",
                    "--tls-replication",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-config-file",
                    f"{node.dir}/nodes.conf",
                    "--masteruser",
                    "app",
                    "--masterauth",
                    PASSWORD,
                ]
            )
        cli = [
            shutil.which("redis-cli"),
            "--tls",
            "--cacert",
            str(certs / "ca.crt"),
            "--user",
            "app",
            "--pass",
            PASSWORD,
            "--no-auth-warning",
        ]
        create = subprocess.run(
            [
                *cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in tls_ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        deadline = time.monotonic() + 30
        while not all(
            "cluster_state:ok"
            in subprocess.run([*cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout
            for port in tls_ports
        ):
            assert time.monotonic() < deadline, "the TLS cluster did not become ok"
            time.sleep(0.2)
        seeds = ",".join(f"127.0.0.1:{port}" for port in tls_ports)
        query = f"?ssl_ca_certs={certs / 'ca.crt'}"
        yield (f"rediss+cluster://app:{PASSWORD}@{seeds}{query}", f"rediss+cluster://app:wrong@{seeds}{query}")
    finally:
        for node in nodes:
            node.stop()


async def test_admission_over_a_tls_cluster_as_an_acl_user(tls_cluster):
    url, wrong = tls_cluster
    access = services(url)
    try:
        store = KeyStore(access.redis)
        tenants = [await store.create(f"tls-cluster-{n}", KeyLimits(requests_per_minute=2)) for n in range(6)]

        def primaries() -> set[str]:
            return {access.redis.get_node_from_key(f"{{k:{record.id}}}").name for record, _ in tenants}

        while len(primaries()) < 2 and len(tenants) < 64:  # key ids are random: six may share a primary
            tenants.append(await store.create(f"tls-cluster-{len(tenants)}", KeyLimits(requests_per_minute=2)))
        keys = [await access.authenticator.authenticate({"authorization": f"Bearer {secret}"}) for _, secret in tenants]
        # Keys on every primary, in one auto-pipeline per turn: each limit exact.
        outcomes = await asyncio.gather(
            *(access.gate.admit(key, "m", 10) for key in keys for _ in range(3)), return_exceptions=True
        )
        for n in range(len(keys)):
            mine = outcomes[3 * n : 3 * n + 3]
            assert sum(isinstance(o, Ticket) and not o.local for o in mine) == 2, mine
            assert sum(isinstance(o, Refusal) and o.kind == "requests" for o in mine) == 1, mine
        assert len({access.redis.get_node_from_key(f"{{k:{key.id}}}").name for key in keys}) > 1
    finally:
        await access.redis.aclose()
    refused = services(wrong)
    try:
        with pytest.raises(OpenAIError) as caught:
            await refused.gate.admit(keys[0], "m", 10)
        assert (caught.value.status, caught.value.code) == (503, "quota_backend_error")
        assert not refused.gate.local._keys
    finally:
        await refused.redis.aclose()


@pytest.fixture(scope="module")
def tls_sentinel(certs, tmp_path_factory):
    """A primary and a replica speaking TLS only (replication too) to user ``app``,
    and three sentinels speaking TLS only: the URL, and the primary."""
    primary, replica = RedisServer(), RedisServer()
    primary_tls, replica_tls = free_port(), free_port()
    sentinel_ports = [free_port() for _ in range(3)]
    sentinels: list[subprocess.Popen] = []
    folder = tmp_path_factory.mktemp("sentinels")
    auth = ["--masteruser", "app", "--masterauth", PASSWORD, "--tls-replication", "yes"]
    try:
        primary.start([*tls_only_to_app(certs, primary_tls), *auth, "--repl-diskless-sync-delay", "0"])
        replica.start([*tls_only_to_app(certs, replica_tls), *auth, "--replicaof", "127.0.0.1", str(primary_tls)])
        cli = [shutil.which("redis-cli"), "--tls", "--cacert", str(certs / "ca.crt")]
        # Synced before the sentinels look: they read the primary's replicas every 10 s.
        deadline = time.monotonic() + 30
        while (
            "master_link_status:up"
            not in subprocess.run(
                [
                    *cli,
                    "--user",
                    "app",
                    "--pass",
                    PASSWORD,
                    "--no-auth-warning",
                    "-p",
                    str(replica_tls),
                    "info",
                    "replication",
                ],
                capture_output=True,
                text=True,
            ).stdout
        ):
            assert time.monotonic() < deadline, "the TLS replica did not sync"
            time.sleep(0.1)
        for port in sentinel_ports:
            conf = folder / f"sentinel-{port}.conf"
            conf.write_text(
                f"port 0\ntls-port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"tls-cert-file {certs / 'server.crt'}\ntls-key-file {certs / 'server.key'}\n"
                f"tls-ca-cert-file {certs / 'ca.crt'}\ntls-auth-clients no\ntls-replication yes\n"
                f"sentinel monitor tls-primary 127.0.0.1 {primary_tls} 2\n"
                f"sentinel auth-user tls-primary app\nsentinel auth-pass tls-primary {PASSWORD}\n"
                f"sentinel down-after-milliseconds tls-primary 2000\n"
            )
            sentinels.append(
                subprocess.Popen(
                    [shutil.which("redis-server"), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60
        while not all(
            str(replica_tls)
            in subprocess.run(
                [*cli, "-p", str(port), "sentinel", "replicas", "tls-primary"], capture_output=True, text=True
            ).stdout
            for port in sentinel_ports
        ):
            assert time.monotonic() < deadline, "the TLS sentinels did not find the primary and its replica"
            time.sleep(0.2)
        seeds = ",".join(f"127.0.0.1:{port}" for port in sentinel_ports)
        yield f"rediss+sentinel://app:{PASSWORD}@{seeds}/tls-primary?ssl_ca_certs={certs / 'ca.crt'}", primary_tls
    finally:
        for sentinel in sentinels:
            sentinel.terminate()
            sentinel.wait(timeout=10)
        replica.stop()
        primary.stop()


async def test_admission_through_tls_sentinels_to_a_tls_primary(tls_sentinel):
    url, primary_tls = tls_sentinel
    access = services(url)
    try:
        _, secret = await KeyStore(access.redis).create("tls-sentinel", KeyLimits(requests_per_minute=2))
        key = await access.authenticator.authenticate({"authorization": f"Bearer {secret}"})
        outcomes = await asyncio.gather(*(access.gate.admit(key, "m", 10) for _ in range(3)), return_exceptions=True)
        assert sum(isinstance(o, Ticket) and not o.local for o in outcomes) == 2, outcomes
        assert sum(isinstance(o, Refusal) and o.kind == "requests" for o in outcomes) == 1, outcomes
        # The sentinels, which listen on TLS only (port 0), named the TLS primary.
        address = await access.redis.connection_pool.get_master_address()
        assert address == ("127.0.0.1", primary_tls)
    finally:
        await access.redis.aclose()
