"""Which client a redis_url makes, and what a bad one is told."""

import pytest
import redis.asyncio.connection
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from serve_app.redis_store import redis_client
from serve_app.settings import AppSettings


def test_single_node_urls_go_to_redis_py_as_they_are():
    for url in ("redis://127.0.0.1:6379/2", "rediss://user:pw@cache.example:6380/0", "unix:///run/redis.sock"):
        assert redis_client.parse(url).mode == "single"
    client = redis_client.connect("rediss://app:s3cret@cache.example:6380/3", timeout_s=0.5)
    assert isinstance(client, Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"], kwargs["socket_timeout"]) == ("app", "s3cret", 3, 0.5)


def test_cluster_url_names_every_seed_and_the_acl_user():
    target = redis_client.parse("rediss+cluster://app:p%40ss@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert target.mode == "cluster" and target.tls
    assert target.hosts == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
    assert (target.username, target.password) == ("app", "p@ss")
    client = redis_client.connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", timeout_s=1)
    assert isinstance(client, RedisCluster)


def test_sentinel_url_names_its_service_and_database():
    target = redis_client.parse("redis+sentinel://:pw@s1:26379,s2:26379/llm-primary/2?sentinel_password=x")
    assert (target.mode, target.service, target.db, target.password) == ("sentinel", "llm-primary", 2, "pw")
    assert target.hosts == [("s1", 26379), ("s2", 26379)]
    client = redis_client.connect("redis+sentinel://s1:26379/llm-primary")
    assert isinstance(client, Redis) and client.connection_pool.service_name == "llm-primary"


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://127.0.0.1:6379", "must start with one of"),
        ("127.0.0.1:6379", "must start with one of"),
        ("redis+sentinel://s1:26379", "names its service"),
        ("redis+sentinel://s1:26379/svc/x", "is not a number"),
        ("redis+cluster://10.0.0.1:7000/3", "database 0 only"),
        ("redis+cluster://10.0.0.1", "is not host:port"),
        ("redis+cluster://", "names no host"),
    ],
)
def test_a_bad_url_is_refused_with_its_problem_named(url, problem):
    with pytest.raises(ValueError, match=problem):
        redis_client.parse(url)
    with pytest.raises(ValidationError, match=problem):
        AppSettings(redis_url=url)


def test_redact_hides_only_the_password():
    assert redis_client.redact("rediss://app:s3cret@h:6380/0") == "rediss://app:***@h:6380/0"
    assert redis_client.redact("redis+cluster://:s3cret@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    assert redis_client.redact("redis://h:6379/0") == "redis://h:6379/0"
    assert redis_client.redact("redis://app@h:6379/0") == "redis://app@h:6379/0"
    # A bracketed IPv6 seed after the first: CPython's urlsplit refuses it (gh-105704).
    seeds = "rediss+cluster://app:p%40ss@10.0.0.1:7000,[::1]:7002/0?ssl_cert_reqs=none"
    assert redis_client.redact(seeds) == "rediss+cluster://app:***@10.0.0.1:7000,[::1]:7002/0?ssl_cert_reqs=none"


def test_pooled_connections_are_checked_before_use():
    """redis-py skips the check that a pooled connection is still open while
    maintenance notifications are on (its default): after a Redis restart each
    pooled connection would fail one command."""
    for url in ("redis://127.0.0.1:6379/0", "unix:///run/redis.sock", "redis+sentinel://s1:26379/llm-primary"):
        assert not redis_client.connect(url).connection_pool.maint_notifications_enabled(), url


def _python_packer(connection, *args):
    """redis-py's own Python packer (its synchronous module's; the asyncio one
    is the method serve_app.redis_store.redis_client replaced)."""
    return PythonRespSerializer(connection._buffer_cutoff, connection.encoder.encode).pack(*args)


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "k", "v"),
        ("CONFIG GET", "maxmemory"),
        (b"CONFIG GET", "maxmemory"),
        ("EVALSHA", "ab12", 2, "llm:rpm:{k:a}", b"raw\x00bytes", 1.5, 0.1, 10**20, -3, "é ü 漢", ""),
        ("SET", "k", bytearray(b"xy")),
        ("SET", "k", memoryview(b"xy")),
        ("SET", "k", "x" * 100_000),
    ],
)
def test_commands_are_packed_in_c_into_the_same_bytes_as_redis_py_packs_them(args):
    connection = redis.asyncio.connection.Connection()
    assert b"".join(connection.pack_command(*args)) == b"".join(_python_packer(connection, *args))
    assert redis.asyncio.connection.AbstractConnection.pack_command is redis_client._pack_in_c


@pytest.mark.parametrize("bad", [None, True, [1], {"a": 1}])
def test_what_redis_cannot_take_is_refused_as_redis_py_refuses_it(bad):
    connection = redis.asyncio.connection.Connection()
    with pytest.raises(DataError):
        _python_packer(connection, "SET", "k", bad)
    with pytest.raises(DataError):
        connection.pack_command("SET", "k", bad)


def test_a_cluster_call_out_of_redirections_is_an_outage_not_a_refusal():
    from redis.exceptions import ClusterError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from serve_app.redis_store.redis_client import UNREACHABLE

    cleared = redis_client.clear_error(ClusterError("TTL exhausted."))
    assert isinstance(cleared, redis_client.ClusterKeptRedirecting)
    assert isinstance(cleared, RedisConnectionError) and isinstance(cleared, UNREACHABLE)
    other = ValueError("not Redis'")
    assert redis_client.clear_error(other) is other
