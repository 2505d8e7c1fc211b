"""Failover on the real stack: the shipped config (`llmctl run`, HAProxy's edge, the
model's direct route), the demo model on two replicas, a steady load of streamed and
unary chats of distinct prompts, each with its own x-request-id.

- One replica's process SIGKILLed: no request that had received nothing fails (the
  edge sends it to the other replica under its one admission, cluster/haproxy_edge.py;
  its record says ``edge:retried``); a stream that was running there ends with an error
  and is charged its reservation (its process, which knew what it delivered, is gone:
  docs/operating.md, "Faults and recovery"); every request has one final record and is
  counted once.
- One replica's EngineCore SIGSTOPped for twice ``first_token_timeout_s``: no request
  fails; a stream that had nothing is aborted there after ``first_token_timeout_s`` and
  answered by the other replica (its record says ``<replica>:stalled``), charged once.

The fallbacks (a model scaled to zero answered by its fallback at its prices; a key not
allowed it gets the original 503) run on the autoscale module's stack
(tests/e2e/test_autoscale_e2e.py)."""

from __future__ import annotations

import datetime
import random
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import openai
import psutil
import pytest
import redis as redis_sync
import yaml
from ports import free_port
from redis_server import RedisServer
from settled import wait_until_settled
from stack import (
    LOCAL_CONFIG,
    CliStack,
    assert_no_other_stack,
    create_key,
    edge_server_states,
    llmctl_status,
    quick_engines,
    replica_engine_processes,
)

from contract.model_config import deployment_name, direct_app_name
from serve_app.redis_store import redis_names

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-llama"
STREAMS, UNARY = 6, 3  # clients of each kind, back to back
MAX_TOKENS = 64
LONG_TOKENS = 400  # a unary answer that takes seconds: in flight, no byte sent, when the fault comes
FIRST_TOKEN_TIMEOUT_S = 8.0
LEASE_S = 10.0  # a dead replica's leases are reaped within this (shipped: 60)
RECOVERY_S = 300  # the killed replica's replacement loads its engine (a minute or two here)
WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly judge boxing".split()


def failover_config(redis_url: str) -> dict:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["http_options"]["port"] = free_port()
    args = config["applications"][0]["args"]
    [model] = quick_engines([m for m in args["models"] if m["name"] == MODEL])
    model["deployment"]["num_replicas"] = 2
    model["cpus_per_replica"] = 0.5  # two replicas and the ingress on this 2-core box
    model["failover"] = {"first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S}
    args["models"] = [model]
    args["redis_url"] = redis_url
    args["records"] = {"sink_dir": tempfile.mkdtemp(prefix="llm-records-")}
    args["quota"] = {"concurrency_lease_s": LEASE_S}
    return config


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis(redis_url):
    client = redis_sync.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    assert_no_other_stack()
    local = CliStack(failover_config(redis_url), redis_url, tmp_path_factory.mktemp("failover"))
    local.start()
    try:
        _, secret = create_key(redis_url, "failover-probe")
        local.wait_serving(secret, timeout_s=600)
        yield local
    finally:
        local.kill()


# -- load ----------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: str  # the client's x-request-id: its record's http_request_id
    streamed: bool
    started: float
    ended: float = 0.0
    kind: str = "truncated"  # completed | error | truncated (ended without a finish reason or an error)
    chunks: int = 0  # stream events received (any: a role event too); a unary answer counts 1
    max_tokens: int = MAX_TOKENS
    completion_tokens: int | None = None
    error: str = ""


@dataclass
class Load:
    """Streamed and unary chats back to back until stopped, each of its own prompt."""

    base_url: str
    secret: str
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(streamed,), daemon=True)
            for streamed in [True] * STREAMS + [False] * UNARY
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a client request hangs"
        return self.outcomes

    def _run(self, streamed: bool) -> None:
        while not self._stop.is_set():
            self.one(streamed)

    def long_answers(self, count: int) -> list[threading.Thread]:
        """``count`` unary chats of LONG_TOKENS at once, each on a thread of its own: a
        few seconds with no byte sent, spread over both replicas by the edge."""
        threads = [threading.Thread(target=self.one, args=(False, LONG_TOKENS), daemon=True) for _ in range(count)]
        for thread in threads:
            thread.start()
        self._threads += threads
        return threads

    def one(self, streamed: bool, max_tokens: int = MAX_TOKENS) -> None:
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.secret, max_retries=0, timeout=90)
        rng = random.Random()
        outcome = Outcome(str(uuid.uuid4()), streamed, time.monotonic(), max_tokens=max_tokens)
        # Distinct prompts: the edge spreads them over both replicas (one prompt
        # would stay on the replica whose cache holds it).
        prompt = " ".join(rng.choice(WORDS) for _ in range(24))
        ask = dict(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": outcome.request_id},
        )
        try:
            if streamed:
                finish = None
                for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
                    outcome.chunks += 1
                    if chunk.usage is not None:
                        outcome.completion_tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                if finish is not None:
                    outcome.kind = "completed"
            else:
                answer = client.chat.completions.create(**ask)
                outcome.chunks, outcome.kind = 1, "completed"
                outcome.completion_tokens = answer.usage.completion_tokens
        except Exception as exc:  # an error of any kind counts: the test judges it
            outcome.kind, outcome.error = "error", f"{type(exc).__name__}: {exc}"[:300]
        outcome.ended = time.monotonic()
        self.outcomes.append(outcome)
        if outcome.kind != "completed":
            time.sleep(0.2)


# -- the stack's state ---------------------------------------------------------------


def model_replicas(stack: CliStack) -> dict[str, int]:
    status = llmctl_status(stack.redis_url)
    return status["serve"]["deployments"][deployment_name(MODEL)]["replicas"] if status else {}


def wait_for_two_replicas(stack: CliStack) -> None:
    """Until Serve runs both of the model's replicas and the edge has both up."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        edge = edge_server_states(f"http-{direct_app_name(MODEL)}")
        up = [name for name, state in edge.items() if state.startswith("UP") and name.startswith("SERVE_REPLICA")]
        if model_replicas(stack) == {"RUNNING": 2} and len(up) == 2:
            return
        assert time.monotonic() < deadline, f"not back to two replicas: {model_replicas(stack)} {edge}"
        time.sleep(1)


def replica_processes() -> list[psutil.Process]:
    title = f"ServeReplica:{direct_app_name(MODEL)}:{deployment_name(MODEL)}"
    return [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if title in p.info["name"] + " ".join(p.info["cmdline"] or [])
    ]


# -- what must hold ------------------------------------------------------------------


def final_records(redis, key_id: str) -> dict[str, list[dict[str, str]]]:
    """The key's final records (tombstones of withdrawn admissions left out), by the
    client's x-request-id, once every one is settled."""
    found = wait_until_settled(redis, key_id, timeout_s=LEASE_S * 3 + 15)
    by_client: dict[str, list[dict[str, str]]] = {}
    for record in found:
        if record["status"] != "withdrawn":
            by_client.setdefault(record.get("http_request_id", ""), []).append(record)
    return by_client


def assert_each_charged_once(redis, key_id: str, outcomes: list[Outcome]) -> dict[str, dict[str, str]]:
    """One final record per request a client made, the completed ones charged what they
    got, and the key's counter of requests counts each once. The records by x-request-id."""
    by_client = final_records(redis, key_id)
    twice = {rid: found for rid, found in by_client.items() if len(found) > 1}
    assert not twice, twice
    mine = {o.request_id for o in outcomes}
    assert set(by_client) <= mine, set(by_client) - mine  # every record is one of these requests'
    for o in outcomes:
        record = by_client[o.request_id][0]
        if o.kind == "completed":
            assert record["status"] == "completed", (o, record)
            assert int(record["completion_tokens"]) == o.completion_tokens == o.max_tokens, (o, record)
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    counted = int(redis.hget(redis_names.usage(key_id), f"d:{today}:requests") or 0)
    assert counted == len(by_client) == len(outcomes), (counted, len(by_client), len(outcomes))
    return {rid: found[0] for rid, found in by_client.items()}


def run_under_load(stack: CliStack, redis, name: str, fault) -> tuple[str, list[Outcome], float, float]:
    """``fault()`` under a steady load; the key, the outcomes, when the fault began and ended."""
    wait_for_two_replicas(stack)
    key_id, secret = create_key(stack.redis_url, f"failover-{name}")
    load = Load(stack.base_url, secret)
    try:
        time.sleep(3)  # steady: streams running on both replicas, others starting
        load.long_answers(4)
        time.sleep(1.5)  # the long answers admitted and generating, on both replicas
        fault_at = time.monotonic()
        fault()
        fault_ended = time.monotonic()
        time.sleep(6)  # served on under load after the fault
    finally:
        outcomes = load.stop()
    assert any(o.started > fault_ended and o.kind == "completed" for o in outcomes), outcomes
    return key_id, outcomes, fault_at, fault_ended


# -- the faults ----------------------------------------------------------------------


def test_one_of_two_replicas_killed_fails_no_request_that_had_received_nothing(stack, redis):
    victim = random.choice(replica_processes())

    key_id, outcomes, fault_at, _ = run_under_load(stack, redis, "kill", victim.kill)

    failed_unstarted = [o for o in outcomes if o.kind != "completed" and o.chunks == 0]
    assert not failed_unstarted, failed_unstarted
    broken = [o for o in outcomes if o.kind != "completed"]
    for o in broken:  # a stream that was running on the killed replica: an error, at once
        assert o.streamed and o.kind == "error" and o.started < fault_at and o.ended - fault_at < 10, o
    found = assert_each_charged_once(redis, key_id, outcomes)
    for o in broken:  # charged its reservation: what it delivered died with its process
        assert found[o.request_id]["status"] == "abandoned", found[o.request_id]
    retried = [r for r in found.values() if "edge:retried" in (r.get("failover") or "")]
    assert retried, "no request was in flight on the killed replica without a byte yet"
    assert all(r["status"] == "completed" for r in retried), retried
    wait_for_two_replicas(stack)  # the next test starts from two again


def test_a_stalled_engine_moves_its_unstarted_streams_and_fails_nothing(stack, redis):
    engines = replica_engine_processes(MODEL)
    assert len(engines) == 2, engines
    stalled = random.choice(engines)

    def fault():
        stalled.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2 * FIRST_TOKEN_TIMEOUT_S)
        finally:
            stalled.send_signal(signal.SIGCONT)

    key_id, outcomes, fault_at, fault_ended = run_under_load(stack, redis, "stall", fault)

    failed = [o for o in outcomes if o.kind != "completed"]
    assert not failed, failed
    found = assert_each_charged_once(redis, key_id, outcomes)
    moved = {rid: r for rid, r in found.items() if ":stalled" in (r.get("failover") or "")}
    assert moved, "no stream was sent to the stalled engine"
    by_id = {o.request_id: o for o in outcomes}
    for rid in moved:
        o = by_id[rid]
        # Silent for first_token_timeout_s on the stalled engine, then answered elsewhere,
        # well before the engine came back.
        assert o.streamed and o.ended - o.started >= FIRST_TOKEN_TIMEOUT_S * 0.9, o
        assert o.started < fault_ended, o
