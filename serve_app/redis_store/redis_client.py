"""One Redis client from one URL: a single node, a Redis Cluster or a Sentinel-managed
primary, with TLS and AUTH/ACL users (docs/architecture.md, State).

    redis://[user:password@]host:port/db          one node (rediss:// for TLS, unix:// too)
    redis+cluster://[user:password@]host:port[,host:port...]
                                                  a Redis Cluster: any nodes as seeds, the
                                                  client follows MOVED/ASK and failovers
    redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]
                                                  the primary the sentinels name for
                                                  ``service``, re-resolved after a failover

``rediss+cluster://`` and ``rediss+sentinel://`` use TLS to the data nodes (query
``ssl_cert_reqs``, ``ssl_ca_certs`` pass through) and, for Sentinel, to the
sentinels too, unless the query says ``sentinel_tls=no`` (sentinels listening in
plain text). Sentinels themselves are reached without credentials unless
``sentinel_password`` (and ``sentinel_username``) is given in the query. Every key one call touches shares one hash tag
(serve_app/redis_store/redis_names.py), so every script and call runs on one slot.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.connection
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ClusterError,
    DataError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
# redis-py 8's pools skip their "is this pooled connection still open?" check
# while maintenance notifications (a Redis Enterprise/Cloud feature) are on, and
# they are on ("auto") by default: after a Redis restart every idle pooled
# connection failed its next command, so a key not in the cache got a 503 (a CI
# run saw it; tests/integration/test_quota_hardening.py). Off for every pool.
_POOL_CHECKS_CONNECTIONS = MaintNotificationsConfig(enabled=False)
# A cluster client tries a call once. redis-py's retries after a connection error
# (3 by default) close every connection of the client first when the call is a
# pipeline, those other calls are using too: on a busy replica whose connects timed
# out on a late loop, every call in flight failed, and their retries did the same
# (the soak: "Connection closed by server" on every node for five minutes, while
# Redis answered everyone else; tests/integration/test_redis_failover.py). And a
# retry waits (0.25 s per pipeline retry, a backoff for a command) where the
# gateway's fail_mode answers at once. The slot map is still learned again after a
# failed call: redis-py does so for a command, AutoPipeline for a pipelined call.
_TRY_ONCE = Retry(NoBackoff(), 0)
# Redis did not answer (it may still run what was sent): a quota decision falls to
# ``quota.fail_mode`` (docs/quotas.md, "Keys and quotas").
UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    TimeoutError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
)
# Anything the client raises about Redis (the cluster client's own errors are not RedisError).
REDIS_FAILED = (RedisError, RedisClusterException)
_TLS_QUERY = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names, parsed once (and checked when settings are loaded)."""

    mode: str  # "single" | "cluster" | "sentinel"
    url: str
    hosts: list[tuple[str, int]] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls: bool = False
    service: str = ""
    db: int = 0
    query: dict[str, str] = field(default_factory=dict)


def parse(url: str) -> RedisTarget:
    """Raises ValueError naming what is wrong (the settings report it)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in SINGLE_SCHEMES:
        return RedisTarget("single", url)
    if scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        known = ", ".join(f"{s}://" for s in SINGLE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES)
        raise ValueError(f"redis_url must start with one of {known}")
    _, netloc, tail = _split(url)
    parts = urlsplit(f"{scheme}://seeds{tail}")
    credentials, _, hostlist = netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    hosts = [_host_port(item) for item in hostlist.split(",") if item]
    if not hosts:
        raise ValueError("redis_url names no host")
    query = dict(parse_qsl(parts.query))
    target: dict[str, Any] = dict(
        mode="cluster" if scheme in CLUSTER_SCHEMES else "sentinel",
        url=url,
        hosts=hosts,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=scheme.startswith("rediss"),
        query=query,
    )
    path = [p for p in parts.path.split("/") if p]
    if target["mode"] == "sentinel":
        if not path:
            raise ValueError("a redis+sentinel:// URL names its service: redis+sentinel://host:26379/mymaster")
        target["service"] = unquote(path[0])
        target["db"] = _db(path[1] if len(path) > 1 else "0")
    elif path and path != ["0"]:
        raise ValueError("a Redis Cluster has database 0 only")
    return RedisTarget(**target)


# Where a write on a connection closed under it fails (redis-py's connection
# module, asyncio's streams and transports).
_TRANSPORT_FILES = (Path(redis.asyncio.connection.__file__).resolve(), Path(asyncio.__file__).resolve().parent)


class CredentialsRefused(ResponseError):
    """Redis refused the URL's user or password (AUTH, ACL): a configuration
    error, not an outage, so never a reason to fail open."""


class ClusterKeptRedirecting(RedisConnectionError):
    """A cluster call used up the client's redirections (ASK, MOVED, TRYAGAIN)
    while its slot was being moved: the slot is not servable right now, an
    outage of that slot (fail_mode), not a refusal."""


class ClusterMapUnknown(RedisConnectionError):
    """The cluster client could not learn which node serves which slot (no node it
    knows answered, or the answers left slots uncovered while a failover moves them):
    an outage of the cluster as this client sees it (fail_mode), not a refusal."""


# Where redis-py's cluster client learns the slot map (NodesManager.initialize).
_CLUSTER_CLIENT_FILE = Path(redis.asyncio.cluster.__file__).resolve()


class _ClearErrors:
    """Two of redis-py's errors say something else than what happened; the
    gateway decides on the error's kind (serve_app/admission/gatekeeper.py), so they are said
    plainly here, for every command of every client ``connect`` makes:

    - A refused AUTH is a ConnectionError subclass: read as "Redis unreachable",
      a wrong password would let fail_mode open admit everything on local
      limits for as long as it stays wrong. It becomes CredentialsRefused.
    - redis-py 8.1 lets a write on a connection that was closed meanwhile (a
      node's connections dropped during a failover, a peer reset of an idle
      pooled connection) escape as AttributeError/TypeError from the transport,
      which no retry and no ``except RedisError`` recognises: the gateway would
      answer 500 instead of applying ``fail_mode``. Seen here when a Redis
      Cluster primary was killed under 16 clients
      (tests/integration/test_redis_failover.py); upstream redis/redis-py#4287,
      fix in PR #4217, not released in 8.1.0. Under uvloop (Ray Serve's event loop)
      the same write raises RuntimeError ("unable to perform operation on
      <TCPTransport closed=True ...>; the handler is closed"): 58 answers of 500 in a
      soak run whose chaos proxy reset every Redis connection (soak/faults.py). Both
      become the ConnectionError they are.
    - A cluster call that ran out of redirections raises ClusterError ("TTL
      exhausted"), which reads as Redis refusing the call (503
      quota_backend_error, even in fail_mode open). It happens while a slot is
      moved (tests/integration/test_redis_resharding.py): redis-py sends ASKING on
      one pooled connection and the command on maybe another, which the target
      answers MOVED, back to the source, until the redirections run out. It
      becomes ClusterKeptRedirecting, an outage of that slot.
    - The cluster client's search for its slot map ends in a RedisClusterException
      when no node it knows answers ("Redis Cluster cannot be connected") or the
      answers leave slots uncovered or disagree (a primary failing over): read as
      Redis refusing, fail_mode open would answer 503 during a failover (a CI run of
      tests/integration/test_redis_failover.py had one). It becomes ClusterMapUnknown,
      an outage; unless a node answered with an error on the way (no cluster mode: a
      misconfigured URL), which stays a refusal, or refused the credentials.
    """

    async def execute_command(self, *args, **options):
        try:
            return await super().execute_command(*args, **options)
        except (
            AuthenticationError,
            AuthorizationError,
            ClusterError,
            RedisClusterException,
            AttributeError,
            TypeError,
            RuntimeError,
        ) as exc:
            cleared = clear_error(exc)
            if cleared is exc:
                raise
            raise cleared from exc


def clear_error(exc: BaseException) -> BaseException:
    """What ``exc``, raised by a command or a pipeline, says plainly (see
    ``_ClearErrors``); anything else is ``exc`` itself."""
    if isinstance(exc, (AuthenticationError, AuthorizationError)):
        return CredentialsRefused(f"Redis refused the credentials of redis_url: {exc}")
    if isinstance(exc, ClusterError):
        return ClusterKeptRedirecting(f"the cluster kept redirecting the call (a slot being moved): {exc}")
    if isinstance(exc, RedisClusterException) and _learning_the_slot_map(exc):
        causes = _causes(exc)
        credentials = [cause for cause in causes if isinstance(cause, (AuthenticationError, AuthorizationError))]
        if credentials:
            return clear_error(credentials[0])
        if any(isinstance(cause, ResponseError) for cause in causes):
            return exc  # a node answered with an error (no cluster mode): a refusal, as it says
        return ClusterMapUnknown(f"the cluster's slot map could not be learned: {exc}")
    if isinstance(exc, (AttributeError, TypeError, RuntimeError)) and _raised_in_transport(exc):
        return RedisConnectionError(f"connection closed while in use ({exc})")
    return exc


def _causes(exc: BaseException) -> list[BaseException]:
    """The exceptions ``exc`` was raised from or while handling, nearest first."""
    chain, seen = [], {id(exc)}
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        chain.append(cause)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return chain


def _learning_the_slot_map(exc: RedisClusterException) -> bool:
    """Raised while the cluster client searched for its slot map."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "initialize" and Path(code.co_filename).resolve() == _CLUSTER_CLIENT_FILE:
            return True
        tb = tb.tb_next
    return False


def _raised_in_transport(exc: BaseException) -> bool:
    """Raised by the transport under redis-py's connection: the innermost frame is
    asyncio's or redis-py's connection module, or uvloop's (compiled: its frames
    name their .pyx sources) called from asyncio's streams."""
    tb = exc.__traceback__
    if tb is None:
        return False
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    while len(frames) > 1 and frames[-1].startswith("uvloop/"):
        frames.pop()
    where = Path(frames[-1]).resolve()
    return any(where == place or place in where.parents for place in _TRANSPORT_FILES)


class SafeRedis(_ClearErrors, redis.asyncio.Redis):  # type: ignore[misc]
    """One node, or a Sentinel's primary."""


# (The ignores: redis-py's own base classes disagree on command_info's signature.)
class SafeRedisCluster(_ClearErrors, RedisCluster):  # type: ignore[misc]
    """A Redis Cluster."""


def connect(url: str, timeout_s: float | None = None):
    """An asyncio client for ``url``: a ``redis.asyncio.Redis`` for one node or a
    Sentinel's primary, a ``RedisCluster`` for a cluster. ``timeout_s`` bounds each
    connect and each reply."""
    target = parse(url)
    timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if target.mode == "single":
        return SafeRedis.from_url(url, **timeouts, maint_notifications_config=_POOL_CHECKS_CONNECTIONS)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    tls: dict[str, Any] = (
        {"ssl": True, **{k: v for k, v in target.query.items() if k in _TLS_QUERY}} if target.tls else {}
    )
    if target.mode == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return SafeRedisCluster(startup_nodes=nodes, retry=_TRY_ONCE, **auth, **tls, **timeouts)
    sentinel_auth: dict[str, Any] = {
        "username": target.query.get("sentinel_username"),
        "password": target.query.get("sentinel_password"),
    }
    sentinel_tls = tls if target.query.get("sentinel_tls", "yes").lower() not in ("no", "false", "0") else {}
    sentinel = Sentinel(target.hosts, sentinel_kwargs={**sentinel_auth, **sentinel_tls, **timeouts}, **timeouts)
    return sentinel.master_for(
        target.service,
        redis_class=SafeRedis,
        db=target.db,
        **auth,
        **tls,
        maint_notifications_config=_POOL_CHECKS_CONNECTIONS,
    )


def _pack_in_c(self, *args) -> list[bytes]:
    """A command in Redis' protocol, packed by hiredis' C packer.

    redis-py's synchronous client packs commands this way whenever hiredis is
    installed (its HiredisRespSerializer); its asyncio client, which the gateway
    uses, still packs argument by argument in Python: half of an ingress' CPU
    per admission (an admit and a settle, ~20 arguments each) in
    bench/admission_throughput.py. Same bytes, same refusal of what Redis cannot
    take (tests/unit/test_redis_client.py compares the two).
    """
    if isinstance(args[0], str):  # 'CONFIG GET' is two words on the wire
        args = tuple(args[0].encode().split()) + args[1:]
    elif b" " in args[0]:
        args = tuple(args[0].split()) + args[1:]
    try:
        return [hiredis.pack_command(args)]
    except TypeError:  # hiredis takes str, bytes, int and float: buffers are copied to bytes
        args = tuple(bytes(arg) if isinstance(arg, (bytearray, memoryview)) else arg for arg in args)
    try:
        return [hiredis.pack_command(args)]
    except TypeError as exc:
        raise DataError(f"Invalid input: {exc}") from None


# Every asyncio connection class (TCP, TLS, unix socket; cluster and Sentinel
# connections derive from them) packs through the one method.
redis.asyncio.connection.AbstractConnection.pack_command = _pack_in_c  # type: ignore[method-assign]


def _split(url: str) -> tuple[str, str, str]:
    """A Redis URL's scheme, netloc (credentials and one host or a seed list) and
    what follows the netloc (path, query). Not urlsplit's: a seed list is no URL
    host, and CPython refuses a bracketed IPv6 seed after the first one
    (gh-105704, in 3.11.12+ and distributions' patched 3.11)."""
    scheme, _, rest = url.partition("://")
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    return scheme, rest[:end], rest[end:]


def redact(url: str) -> str:
    """``url`` without its password, for logs and status output."""
    scheme, netloc, tail = _split(url)
    credentials, at, hostlist = netloc.rpartition("@")
    if "://" not in url or not at or ":" not in credentials:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostlist}{tail}"


def _host_port(item: str) -> tuple[str, int]:
    host, _, port = item.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"redis_url: {item!r} is not host:port")
    return host.strip("[]"), int(port)


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"redis_url: database {text!r} is not a number")
    return int(text)


def as_text(value: bytes | str) -> str:
    """A Redis reply as text (clients without decode_responses answer bytes)."""
    return value.decode() if isinstance(value, bytes) else value


_send_packed = redis.asyncio.connection.AbstractConnection.send_packed_command


async def _send_on_a_live_transport(self, command, check_health: bool = True) -> None:
    """redis-py's send, once more on a new connection when the pooled one's transport
    was closed while it sat idle (its peer went away: under uvloop the write raises
    RuntimeError, under asyncio's streams AttributeError, both of which redis-py lets
    through). The write failed as a whole, so nothing of the command was sent and
    sending it again is safe for any command. The soak met it at 200 clients with no
    fault injected: 3 requests answered 503 (docs/operating.md, "Soak")."""
    try:
        return await _send_packed(self, command, check_health)
    except (RuntimeError, AttributeError) as exc:
        if not _raised_in_transport(exc):
            raise
        await self.disconnect(nowait=True)
    return await _send_packed(self, command, check_health)  # connects first: it is not connected


redis.asyncio.connection.AbstractConnection.send_packed_command = _send_on_a_live_transport  # type: ignore[method-assign]
