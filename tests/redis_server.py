"""Private, real Redis servers for tests: one node (stoppable, for outage tests)
or a Redis Cluster of several."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import weakref

from ports import free_port


class RedisServer:
    def __init__(self, persistent: bool = False):
        """``persistent``: keep data across stop/start (append-only file), for outage tests."""
        self.persistent = persistent
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        # Its directory goes with it (or at exit): a full suite creates hundreds.
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, extra_args: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make test installs it)"
        self.extra_args = extra_args if extra_args is not None else getattr(self, "extra_args", [])
        self.proc = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "yes" if self.persistent else "no",
                "--appendfsync",
                "always",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def _cli(port: int, *command: str) -> str:
    done = subprocess.run(
        [shutil.which("redis-cli"), "-p", str(port), *command], capture_output=True, text=True, timeout=10
    )
    return done.stdout


@contextlib.contextmanager
def running_redis(persistent: bool = False):
    """A started RedisServer for the length of the block (fixtures wrap this)."""
    server = RedisServer(persistent=persistent)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisClusterServers:
    """A real Redis Cluster on loopback: ``primaries`` primaries, each with
    ``replicas`` replicas (``redis-cli --cluster create``). ``url`` is the
    gateway's ``redis+cluster://`` form, every node a seed."""

    def __init__(self, primaries: int = 3, replicas: int = 1, announce_ports: list[int] | None = None):
        """``announce_ports``: the port each node tells clients to reach it on (a
        proxy in front of it: soak/topology.py), one per node; its own by default."""
        self.primaries, self.replicas = primaries, replicas
        self.nodes = [RedisServer() for _ in range(primaries * (1 + replicas))]
        self.announce_ports = announce_ports or [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.announce_ports)

    def start(self) -> None:
        for node, announced in zip(self.nodes, self.announce_ports):
            # The bus port is explicit: the default (port + 10000) overflows for high free ports.
            # No 5 s wait before a replica's first sync (repl-diskless-sync-delay).
            node.start(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-config-file",
                    f"{node.dir}/nodes.conf",
                    "--repl-diskless-sync-delay",
                    "0",
                    *(
                        ["--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", str(announced)]
                        if announced != node.port
                        else []
                    ),
                ]
            )
        create = subprocess.run(
            [
                shutil.which("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.announce_ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        # Ready when every node sees the cluster ok and every replica has synced: a
        # replica that never synced refuses to take over (cluster-replica-validity-factor).
        deadline = time.monotonic() + 30
        while not (
            all("cluster_state:ok" in _cli(node.port, "cluster", "info") for node in self.nodes)
            and self._replicas_synced()
        ):
            assert time.monotonic() < deadline, "the Redis Cluster did not become ok with every replica synced"
            time.sleep(0.2)

    def _replicas_synced(self) -> bool:
        roles = [_cli(node.port, "info", "replication") for node in self.nodes]
        replicas = [role for role in roles if "role:slave" in role]
        return len(replicas) == self.primaries * self.replicas and all(
            "master_link_status:up" in role for role in replicas
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def running_redis_cluster(primaries: int = 3, replicas: int = 1):
    cluster = RedisClusterServers(primaries, replicas)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def every_node(client, primaries: bool = False) -> dict:
    """Keyword arguments that send a server command (CONFIG, INFO; FLUSHDB with
    ``primaries``: replicas refuse writes) to every node of a cluster client; none
    for one node."""
    from redis.asyncio.cluster import RedisCluster

    if not isinstance(client, RedisCluster):
        return {}
    return {"target_nodes": RedisCluster.PRIMARIES if primaries else RedisCluster.ALL_NODES}


class RedisSentinelSetup:
    """A Sentinel-managed Redis on loopback: one primary, one replica, three
    sentinels watching service ``service`` (quorum 2). ``url`` is the gateway's
    ``redis+sentinel://`` form, every sentinel a seed."""

    def __init__(self, service: str = "llm-primary"):
        self.service = service
        self.primary, self.replica = RedisServer(), RedisServer()
        self.sentinel_ports = [free_port() for _ in range(3)]  # free_port never gives one twice
        self.sentinels: list[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="redis-sentinel-")
        weakref.finalize(self, shutil.rmtree, self.dir, True)

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.service}"

    def start(self) -> None:
        self.primary.start(["--repl-diskless-sync-delay", "0"])  # no 5 s wait before the replica's first sync
        self.replica.start(["--replicaof", "127.0.0.1", str(self.primary.port)])
        for port in self.sentinel_ports:
            conf = f"{self.dir}/sentinel-{port}.conf"
            with open(conf, "w") as out:
                out.write(
                    f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                    f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
                    f"sentinel down-after-milliseconds {self.service} 2000\n"
                    f"sentinel failover-timeout {self.service} 10000\n"
                )
            with open(f"{self.dir}/sentinel-{port}.log", "w") as log:
                self.sentinels.append(
                    subprocess.Popen(
                        [shutil.which("redis-server"), conf, "--sentinel"], stdout=log, stderr=subprocess.STDOUT
                    )
                )
        # A sentinel learns of replicas from the primary's INFO, which it reads every
        # 10 s: a replica that connects just after the first read waits for the next.
        deadline = time.monotonic() + 60
        while missing := self._not_ready():
            assert time.monotonic() < deadline, f"the sentinel setup is not ready: {missing}\n{self._logs()}"
            time.sleep(0.2)

    def _not_ready(self) -> str:
        """What the setup still lacks, or ''."""
        blind = [port for port in self.sentinel_ports if not self._sees_replica(port)]
        if blind:
            return f"sentinels on {blind} do not list the replica on {self.replica.port}"
        if "master_link_status:up" not in _cli(self.replica.port, "info", "replication"):
            return "the replica's link to the primary is not up"
        if not self._replica_acknowledges():
            return "the replica does not acknowledge a write (WAIT)"
        return ""

    def _logs(self) -> str:
        tails = []
        for port in self.sentinel_ports:
            with open(f"{self.dir}/sentinel-{port}.log") as log:
                tails.append(f"--- sentinel {port} ---\n" + "".join(log.readlines()[-15:]))
        return "\n".join(tails)

    def _replica_acknowledges(self) -> bool:
        """A write on the primary is acknowledged by the replica (WAIT): right
        after the first sync, a replica can still be reconnecting."""
        _cli(self.primary.port, "set", "harness:ready", "1")
        return _cli(self.primary.port, "wait", "1", "200").strip() == "1"

    def _sees_replica(self, port: int) -> bool:
        return str(self.replica.port) in _cli(port, "sentinel", "replicas", self.service)

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.terminate()
            sentinel.wait(timeout=10)
        self.sentinels = []
        self.replica.stop()
        self.primary.stop()


@contextlib.contextmanager
def running_redis_sentinel():
    setup = RedisSentinelSetup()
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


def sync_client(url: str):
    """A synchronous client of what ``url`` names (one node or a cluster), for a
    test's assertions on what the gateway stored."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    from serve_app.redis_store.redis_client import parse

    target = parse(url)
    if target.mode == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.hosts])
    assert target.mode == "single", f"no synchronous test client for {target.mode}"
    return redis.Redis.from_url(url)
