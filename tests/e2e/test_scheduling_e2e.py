"""Who runs where and first, on the real stack: prefix-affinity routing
(serve_app/routing/serve_routers.py) and keys' priority tiers (serve_app/pipeline/gateway.py, vLLM's
priority scheduling). Requests go through the OpenAI SDK or plain HTTP; where
each one ran is read from its request record in Redis.

Two models: the demo chat model on two vLLM replicas behind its direct route, as
shipped (routing: ``/v1`` takes one hop, the replica chosen at the edge by the
model's router, serve_app/http/edge_router.py; the ingress' routes reach it through a
handle and the same router), and a copy on one replica whose engine runs one
sequence at a time with priority scheduling, four requests per replica and a Serve
queue of four (tiers).

- Requests that share a system prompt run on the replica that prefix ranks
  first, every time, and different prefixes use both replicas.
- A flood on one prefix does not queue on its replica alone: past the load
  guard the other replica takes the overflow.
- A high-priority key's request waiting in the engine runs before a low one's
  that came earlier.
- As the model's queue fills, low keys are refused first, then normal keys;
  the last places are high keys'. Refused requests are charged nothing.
- Fair share: a light key's request overtakes a heavy key's backlog waiting
  at the gateway (first come, first served would run it last).
- A cache-affinity replica tells the routers what its engine holds (its KV-cache events).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from copy import deepcopy

import httpx
import openai
import pytest
import redis as redis_sync
from ports import free_port
from settled import records as records_of
from settled import wait_until_settled
from stack import (
    APP_NAME,
    cache_salt,
    call_replica,
    create_key,
    edge_server_states,
    edge_server_stats,
    local_app_args,
    serve_stack,
)

from serve_app.routing.policies import prompt_prefix, rendezvous_order

pytestmark = pytest.mark.e2e

MODEL, TIERED, FAIR = "tiny-llama", "tiny-llama-tiers", "tiny-llama-fair"
ALIAS, ADAPTER = "tiny-llama-latest", "tiny-llama-pirate"
PREFIX_CHARS, GUARD = 512, 4  # RoutingSettings defaults
TIERED_ONGOING, TIERED_QUEUE = 4, 4  # queue shares (defaults): low 2, normal 3, high 4
# Seconds of the engine's one sequence (3-4 s on an idle box), within the demo model's
# context. Not longer: a blocker still waiting in the engine cannot be hung up (its
# client sees no chunk to stop at), and a 16,000-token one outlasted the queue timeout
# of the requests behind it.
BLOCKER_TOKENS = 2000


@pytest.fixture(scope="module")
def base_url(redis_server):
    args = {**local_app_args(only=[MODEL]), "redis_url": redis_server.url}
    [chat] = args["models"]
    tiered = deepcopy(chat)
    chat["cpus_per_replica"] = 0.5  # four engines and the ingress on two CPUs
    chat["deployment"] = {**chat["deployment"], "num_replicas": 2}
    # Behind its direct route, as shipped: /v1 takes one hop, the replica chosen at the
    # edge by the model's router (serve_app/http/edge_router.py); the ingress' own
    # routes reach it through a handle and the same router.
    assert chat["direct_route"]
    # Its other names take the same one hop: an alias, and LoRA adapters (the replica
    # that holds one is chosen at the edge).
    chat["aliases"] = [ALIAS]
    chat["lora"] = {"adapters": {ADAPTER: "demo"}, "max_adapters_per_replica": 1, "max_rank": 8}
    tiered.update(name=TIERED, cpus_per_replica=0.25)
    # TIERED and FAIR take the ingress' path: their tests are about the ingress' queue
    # shares and fair-share queue, which see the whole model's requests there.
    tiered.pop("direct_route", None)
    tiered["engine_kwargs"] = {**tiered["engine_kwargs"], "max_num_seqs": 1, "scheduling_policy": "priority"}
    tiered["deployment"] = {
        **tiered["deployment"],
        "max_ongoing_requests": TIERED_ONGOING,
        "max_queued_requests": TIERED_QUEUE,
    }
    # Past the replica's four places, requests wait in fair order; no place kept for
    # light keys (these tests pin the queue shares and the order of one backlog).
    tiered["fair_share"] = {"enabled": True, "light_key_places": 0}
    # Two places, one kept for keys with nothing in flight.
    fair = deepcopy(tiered)
    fair.update(name=FAIR)
    fair["engine_kwargs"] = {**tiered["engine_kwargs"], "max_num_seqs": 2}
    fair["deployment"] = {**tiered["deployment"], "max_ongoing_requests": 2}
    fair["fair_share"] = {"enabled": True, "light_key_places": 1}
    # Routed by what its replica's engine says it holds (its KV-cache events): one replica
    # chooses nothing, but it publishes what it holds to the routers all the same.
    fair["routing"] = {"policy": "cache_affinity"}
    args["models"] += [tiered, fair]
    with serve_stack(args, port=free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def replica_ids(base_url) -> list[str]:
    """The two replicas' ids, as the router and the records name them, once both run."""
    import ray
    from ray import serve

    from contract.model_config import deployment_name, direct_app_name

    def running() -> int:
        app = serve.status().applications.get(direct_app_name(MODEL))
        deployment = app and app.deployments.get(deployment_name(MODEL))
        return deployment.replica_states.get("RUNNING", 0) if deployment else 0

    deadline = time.monotonic() + 600
    while running() != 2:
        assert time.monotonic() < deadline, serve.status()
        time.sleep(1)
    prefix = f"SERVE_REPLICA::{direct_app_name(MODEL)}#{deployment_name(MODEL)}#"
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    ids = sorted(name[len(prefix) :] for name in names if name.startswith(prefix))
    assert len(ids) == 2, names
    return ids


@pytest.fixture(scope="module")
def key(redis_server) -> tuple[str, str]:
    return create_key(redis_server.url, "routing", requests_per_minute=100_000, max_concurrent=100)


@pytest.fixture(scope="module")
def salt(redis_server, key) -> str:
    """The cache salt of ``key``'s requests (a key without a team: its own cache), which
    the routers hash before the prompt (serve_app/identity/cache_isolation.py)."""
    return cache_salt(redis_server.url, "key:" + key[0])


def edge_states(replica_ids: list[str]) -> dict[str, str]:
    """HAProxy's state of each replica in the backend it sends the edge router's picks
    to (a replica it holds down gets none of them: HAProxy balances instead)."""
    from contract.model_config import direct_app_name

    states = edge_server_states(f"http-{direct_app_name(MODEL)}-via-ingress-request-router")
    return {
        rid: next((state for name, state in states.items() if name.endswith("-" + rid)), "absent")
        for rid in replica_ids
    }


@pytest.fixture(scope="module")
def client(base_url, key, replica_ids, redis_server, salt):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key[1], max_retries=0, timeout=300)
    deadline = time.monotonic() + 600
    while True:  # both replicas answer (the first may come up well before the second)
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline
            time.sleep(2)
    # And the edge sends to both: a replica just started is in HAProxy's map only after
    # Ray's next reload, and held down until its health checks pass.
    while not all(state.startswith("UP") for state in edge_states(replica_ids).values()):
        assert time.monotonic() < deadline, edge_states(replica_ids)
        time.sleep(0.5)
    # And the edge router knows both: its replicas come by Serve's long poll, which may
    # trail HAProxy's reload (a CI run sent the first request of a prefix preferring the
    # second replica to the first, then every later one right). Until then a replica it
    # does not know takes nothing, as it should.
    for replica in replica_ids:
        [system] = system_prompts_preferring(replica, replica_ids, 1, salt, title="Warm-up")
        while replicas_that_ran(redis_server, key, [send(client, conversation(system, "hi"))]) != [replica]:
            assert time.monotonic() < deadline, f"the edge router never sent a prompt preferring {replica} there"
            time.sleep(1)
    return client


def system_prompts_preferring(
    replica: str, replica_ids: list[str], count: int, salt: str | None, title: str = "Policy book"
) -> list[str]:
    """Distinct long system prompts whose prefix, under the cache salt ``salt``, ranks
    ``replica`` first."""
    found = []
    n = 0
    while len(found) < count:
        system = f"{title} {n}. " + "Answer politely, cite the policy, never promise refunds. " * 30
        prefix = prompt_prefix({"messages": conversation(system, ""), "cache_salt": salt}, PREFIX_CHARS)
        assert prefix.startswith(f"\x1d{salt}\x1dsystem\x1f{title}")  # the body as the router reads it
        if rendezvous_order(prefix, replica_ids)[0] == replica:
            found.append(system)
        n += 1
    return found


def conversation(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def replicas_that_ran(redis_server, key, request_ids: list[str]) -> list[str]:
    """The replica each request ran on, from its record in Redis."""
    records = wait_until_settled(redis_sync.Redis.from_url(redis_server.url), key[0])
    by_id = {record["http_request_id"]: record for record in records}
    return [by_id[request_id]["replica"] for request_id in request_ids]


def send(client, messages, max_tokens: int = 2, model: str = MODEL, headers: dict | None = None, **extra) -> str:
    """One chat request (with ``headers``); its x-request-id."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, extra_body=extra or None, extra_headers=headers
    )
    raw.parse()
    return raw.headers["x-request-id"]


def test_a_shared_prefix_runs_on_the_replica_it_ranks_first(client, replica_ids, redis_server, key, salt):
    sent: list[tuple[str, str]] = []  # (request id, replica its prefix ranks first)
    for replica in replica_ids:
        for system in system_prompts_preferring(replica, replica_ids, 3, salt):
            for question in ("Where is my parcel?", "Cancel my order", "Do you ship to Mars?"):
                sent.append((send(client, conversation(system, question)), replica))
    ran = replicas_that_ran(redis_server, key, [request_id for request_id, _ in sent])
    assert ran == [preferred for _, preferred in sent], f"HAProxy's servers now: {edge_states(replica_ids)}"
    assert set(ran) == set(replica_ids)  # different prefixes use both replicas


def test_through_the_ingress_the_model_is_routed_by_the_same_router(base_url, key, replica_ids, redis_server, salt):
    """Routes the edge does not send in one hop (here Azure's chat route) reach the
    model through the ingress' handle, whose request router is the same class: a
    shared prefix runs on the replica it ranks first there too."""
    ingress = openai.OpenAI(
        base_url=base_url + "/models",
        api_key=key[1],
        max_retries=0,
        timeout=300,
        default_headers={"extra-parameters": "pass-through"},
    )
    sent = []
    for replica in replica_ids:
        for system in system_prompts_preferring(replica, replica_ids, 2, salt):
            sent.append((send(ingress, conversation(system, "Where is my parcel?")), replica))
    assert replicas_that_ran(redis_server, key, [request_id for request_id, _ in sent]) == [r for _, r in sent]


def test_a_flood_on_one_prefix_overflows_to_the_other_replica(base_url, client, replica_ids, redis_server, key, salt):
    preferred = replica_ids[0]
    [system] = system_prompts_preferring(preferred, replica_ids, 1, salt)
    streams = 12
    # Long generations, each streaming before the next is sent, so every one is routed
    # while the earlier ones run: the router sees the queues the guard is about (sent
    # together from a thread pool, a loaded box spread them out and the first ones
    # ended before the last were routed: 11 of 12 on one replica in a CI run).
    flood = []
    try:
        for i in range(streams):
            flood.append(started(base_url, key[1], 400, model=MODEL, messages=conversation(system, f"question {i}")))
        for stream in flood:  # run to their end: each settles with the replica that ran it
            stream.join(300)
            assert stream.status == 200 and stream.body.endswith(b"data: [DONE]\n\n"), stream.body[-300:]
    finally:
        stop_all(flood)
    request_ids = [stream.request_id for stream in flood]
    ran = replicas_that_ran(redis_server, key, request_ids)
    on_preferred = ran.count(preferred)
    print(f"flood of {streams}: {on_preferred} on the preferred replica")
    # The guard keeps the preferred replica at most GUARD requests ahead: it takes
    # about half of the flood plus the guard, the other replica the rest.
    assert streams - on_preferred >= (streams - GUARD) // 2 - 1, ran
    assert on_preferred > streams - on_preferred, ran  # still the prefix's replica first


def test_with_a_session_header_each_conversation_keeps_its_own_replica(
    base_url, client, replica_ids, redis_server, key, salt
):
    """Each turn of a session runs on the replica its session ranks first; the session
    is its tenant's (hashed with its salt, serve_app/identity/cache_isolation.py), so
    another tenant sending the same ids runs where its own salt ranks them: on the other
    replica for every id here, never with the first tenant's conversation."""
    from contract.edge import DEFAULT_SESSION_HEADER
    from serve_app.identity.cache_isolation import HEADER_SESSION, CacheSalts
    from serve_app.routing.policies import SESSION_KEY

    other_key = create_key(redis_server.url, "session-other", requests_per_minute=100_000, max_concurrent=100)
    other_salt = cache_salt(redis_server.url, "key:" + other_key[0])
    other = openai.OpenAI(base_url=base_url + "/v1", api_key=other_key[1], max_retries=0, timeout=300)

    def first(session: str, tenant_salt: str) -> str:
        session_id = CacheSalts.session(tenant_salt, session, HEADER_SESSION)
        return rendezvous_order(SESSION_KEY + session_id, replica_ids)[0]

    # One application: every conversation starts with its system prompt, which ranks
    # one replica first. By prefix they all run there; by session each runs on the
    # replica its session id ranks first, every turn.
    [system] = system_prompts_preferring(replica_ids[0], replica_ids, 1, salt)

    # Three sessions ranking each replica first for this key and the other for the other
    # key, chosen from the replica ids of this run (a quarter of the names qualify).
    def ranking_first(replica: str):
        names = (f"conversation-{i}" for i in itertools.count())
        return itertools.islice((n for n in names if first(n, salt) == replica != first(n, other_salt)), 3)

    sessions = sorted(session for replica in replica_ids for session in ranking_first(replica))
    expected, sent, theirs, expected_theirs = [], [], [], []
    for turn in range(2):
        for session in sessions:
            messages = conversation(system, f"{session}: turn {turn}")
            sent.append(send(client, messages, headers={DEFAULT_SESSION_HEADER: session}))
            expected.append(first(session, salt))
            theirs.append(send(other, messages, headers={DEFAULT_SESSION_HEADER: session}))
            expected_theirs.append(first(session, other_salt))
    assert replicas_that_ran(redis_server, key, sent) == expected
    assert replicas_that_ran(redis_server, other_key, theirs) == expected_theirs


def one_hop_counts(replica_ids: list[str]) -> dict[str, int]:
    """The requests HAProxy has sent each replica straight from the edge (the backend
    its edge router's picks go to) since its last reload."""
    from contract.model_config import direct_app_name

    stats = edge_server_stats(f"http-{direct_app_name(MODEL)}-via-ingress-request-router")
    return {
        rid: sum(int(row["stot"]) for name, row in stats.items() if name.endswith("-" + rid)) for rid in replica_ids
    }


def test_an_alias_and_an_adapter_take_the_one_hop_and_the_adapter_runs_where_it_is_loaded(
    base_url, client, replica_ids, redis_server, key, salt
):
    """Every name of the model takes the edge's one hop (cluster/haproxy_edge.py: the
    names its replicas gave), and the edge router sends an adapter's requests to the
    replica that holds it (Serve's multiplexing), whatever replica their prompt ranks first."""
    before = one_hop_counts(replica_ids)
    sent = [send(client, conversation("Be brief.", "hi"), model=ALIAS)]
    sent.append(send(client, conversation("Be brief.", "hi"), model=ADAPTER))
    # The replica that loaded it tells Serve; the edge router learns it (Serve's long poll).
    time.sleep(3)
    systems = [s for replica in replica_ids for s in system_prompts_preferring(replica, replica_ids, 3, salt)]
    sent += [send(client, conversation(system, "Ahoy?"), model=ADAPTER) for system in systems]
    after = one_hop_counts(replica_ids)
    ran = replicas_that_ran(redis_server, key, sent)
    # Each went from the edge straight to the replica that ran it: none through the ingress.
    assert {rid: after[rid] - before[rid] for rid in replica_ids} == {rid: ran.count(rid) for rid in replica_ids}
    assert len(set(ran[1:])) == 1, ran  # all on the replica that loaded the adapter (one holds it)
    # The names the edge knows them by are no client's to read.
    answer = httpx.get(f"{base_url}/direct/{MODEL}/-/edge-names", timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_url"


def test_one_prompt_of_two_tenants_runs_where_each_tenants_salt_ranks_it(
    base_url, client, replica_ids, redis_server, key, salt
):
    """The routers hash a request's cache salt with its prompt (its tenant's cache:
    serve_app/identity/cache_isolation.py): a prompt cached for one tenant attracts
    that tenant's requests, never another's, which go where their own salt ranks the
    prompt; at the edge (the router there authenticates the credential HAProxy hands
    it) as through the ingress."""
    other_key = create_key(redis_server.url, "routing-other", requests_per_minute=100_000, max_concurrent=100)
    other_salt = cache_salt(redis_server.url, "key:" + other_key[0])
    other = openai.OpenAI(base_url=base_url + "/v1", api_key=other_key[1], max_retries=0, timeout=300)
    systems = []  # ranking one replica first for this test's key and the other for the other key
    for replica in replica_ids:
        for system in system_prompts_preferring(replica, replica_ids, 40, salt, title="Shared manual"):
            prefix = prompt_prefix({"messages": conversation(system, ""), "cache_salt": other_salt}, PREFIX_CHARS)
            if rendezvous_order(prefix, replica_ids)[0] != replica:
                systems.append((system, replica))
                break
    assert len(systems) == 2, "no prompt ranks the replicas apart for the two salts"
    mine, theirs, expected_mine, expected_theirs = [], [], [], []
    for system, replica in systems:
        other_replica = next(r for r in replica_ids if r != replica)
        for question in ("Where is my parcel?", "Cancel my order"):
            mine.append(send(client, conversation(system, question)))
            expected_mine.append(replica)
            theirs.append(send(other, conversation(system, question)))
            expected_theirs.append(other_replica)
    assert replicas_that_ran(redis_server, key, mine) == expected_mine
    assert replicas_that_ran(redis_server, other_key, theirs) == expected_theirs


def test_a_prompt_cache_key_keeps_one_tenants_requests_on_one_replica(
    base_url, client, replica_ids, redis_server, key, salt
):
    """OpenAI's ``prompt_cache_key``: requests of one tenant naming one key run on one
    replica, whatever their prompts start with (by prefix they would use both), the
    replica the key's session ranks first within the tenant; through the SDK's own
    parameter, at the edge."""
    from serve_app.identity.cache_isolation import CacheSalts
    from serve_app.routing.policies import SESSION_KEY

    def preferring(replica: str):
        names = (f"agent-{i}" for i in itertools.count())
        session = (
            n for n in names if rendezvous_order(SESSION_KEY + CacheSalts.session(salt, n), replica_ids)[0] == replica
        )
        return next(session)

    systems = [s for replica in replica_ids for s in system_prompts_preferring(replica, replica_ids, 2, salt)]
    sent, expected = [], []
    for replica in replica_ids:
        cache_key = preferring(replica)
        for system in systems:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=conversation(system, "hi"), max_tokens=2, prompt_cache_key=cache_key
            )
            raw.parse()
            sent.append(raw.headers["x-request-id"])
            expected.append(replica)
    assert replicas_that_ran(redis_server, key, sent) == expected


# -- priority tiers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tier_keys(base_url, redis_server, replica_ids) -> dict[str, tuple[str, str]]:
    keys = {tier: create_key(redis_server.url, f"tier-{tier}", priority=tier) for tier in ("high", "normal", "low")}
    deadline = time.monotonic() + 600
    while _chat(base_url, keys["high"][1], 1).status_code != 200:  # the tiered model is up
        assert time.monotonic() < deadline
        time.sleep(2)
    return keys


def _chat(base_url: str, secret: str, max_tokens: int, model: str = TIERED, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(
        base_url + "/v1/chat/completions", json=body, timeout=300, headers={"authorization": f"Bearer {secret}"}
    )


class Stream(threading.Thread):
    """One streamed request in the background: its status, when its first
    chunk came, when it ended; ``stop`` hangs up."""

    def __init__(
        self, base_url: str, secret: str, max_tokens: int, model: str = TIERED, messages: list[dict] | None = None
    ):
        super().__init__(daemon=True)
        self.base_url, self.secret, self.max_tokens, self.model = base_url, secret, max_tokens, model
        self.messages = messages or [{"role": "user", "content": "hi"}]
        self.request_id = ""
        self.status: int | None = None
        self.body = b""
        self.first_chunk = threading.Event()
        self.stopping = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "min_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                self.base_url + "/v1/chat/completions",
                json=body,
                timeout=300,
                headers={"authorization": f"Bearer {self.secret}"},
            ) as response:
                self.status = response.status_code
                self.request_id = response.headers.get("x-request-id", "")
                for chunk in response.iter_bytes():
                    self.first_chunk.set()
                    self.body += chunk
                    if self.stopping.is_set():
                        break
        except httpx.HTTPError as exc:  # the test reads it from the body it asserts on
            self.body += f"client error: {exc!r}".encode()
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)


def at_replica(model: str, count: int) -> None:
    """Wait until ``model``'s one replica holds ``count`` requests (a fixed sleep was
    too short on a loaded box: a request still on its way counted in the gateway's
    queue and shifted every tier's refusal by one)."""
    import ray

    from contract.model_config import deployment_name

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment_name(model)}#"
    [name] = [
        actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith(prefix)
    ]
    replica = ray.get_actor(name, namespace="serve")
    deadline = time.monotonic() + 60
    while (held := ray.get(replica.get_num_ongoing_requests.remote())) != count:
        assert time.monotonic() < deadline, f"{model}'s replica holds {held}, not {count}"
        time.sleep(0.05)


def admitted(redis_url: str, key_id: str, count: int) -> None:
    """Wait until ``key_id`` has ``count`` request records: its requests have passed
    admission, and the gateway has counted each in its queue or refused it. Requests
    sent from threads 50 ms apart reached the gateway out of order on a loaded box."""
    redis = redis_sync.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while (found := len(records_of(redis, key_id))) < count:
        assert time.monotonic() < deadline, f"{found} of {count} requests of {key_id} admitted"
        time.sleep(0.02)


def stop_all(streams: list) -> None:
    for stream in streams:
        stream.stopping.set()
    for stream in streams:
        stream.join(60)


def started(
    base_url: str,
    secret: str,
    max_tokens: int,
    wait_for_first_chunk: bool = True,
    model: str = TIERED,
    messages: list[dict] | None = None,
) -> Stream:
    stream = Stream(base_url, secret, max_tokens, model, messages)
    stream.start()
    if wait_for_first_chunk:
        assert stream.first_chunk.wait(300)
    return stream


def test_a_high_key_waiting_in_the_engine_runs_before_an_earlier_low_one(base_url, tier_keys):
    blocker = started(base_url, tier_keys["high"][1], BLOCKER_TOKENS)  # the engine's one sequence
    low = started(base_url, tier_keys["low"][1], 20, wait_for_first_chunk=False)
    at_replica(TIERED, 2)
    time.sleep(0.5)  # from the replica into the engine's waiting queue, first
    high = started(base_url, tier_keys["high"][1], 20, wait_for_first_chunk=False)
    at_replica(TIERED, 3)
    assert not low.first_chunk.is_set() and not high.first_chunk.is_set()  # both still wait
    blocker.stop()  # the engine takes the next waiting request: by priority, not by arrival
    for stream in (low, high):
        stream.join(300)
        assert stream.status == 200 and stream.body.endswith(b"data: [DONE]\n\n"), stream.body[-300:]
    assert high.ended_at < low.ended_at


def test_as_the_queue_fills_lower_tiers_are_refused_first(base_url, tier_keys, redis_server):
    # The replica's four places: long streams of a high key.
    # One runs in the engine, three wait in it (its one sequence): their first
    # chunks would come one after another, so none is waited for.
    running = [
        started(base_url, tier_keys["high"][1], BLOCKER_TOKENS, wait_for_first_chunk=False)
        for _ in range(TIERED_ONGOING)
    ]
    try:
        _fill_the_queue_in_tier_order(base_url, tier_keys, redis_server, running)
    finally:
        stop_all(running)  # a failure here must not leave the next test a busy replica


def _fill_the_queue_in_tier_order(base_url, tier_keys, redis_server, running) -> None:
    at_replica(TIERED, TIERED_ONGOING)
    # Then, quickly and in this order (the first blocker runs for seconds yet): each
    # request either waits for a place or is refused at once.
    tiers = ["low", "low", "low", "normal", "normal", "high", "high"]
    redis = redis_sync.Redis.from_url(redis_server.url)
    sent = {tier: len(records_of(redis, key_id)) for tier, (key_id, _) in tier_keys.items()}
    offers = []
    for tier in tiers:
        offers.append(started(base_url, tier_keys[tier][1], 4, wait_for_first_chunk=False))
        sent[tier] += 1
        admitted(redis_server.url, tier_keys[tier][0], sent[tier])  # one at a time, in this order
    time.sleep(1.5)
    outcome = [None if stream.is_alive() else stream.status for stream in offers]
    assert outcome == [None, None, 503, None, 503, None, 503], [s.body[:200] for s in offers]
    for tier, stream in zip(tiers, offers):
        if not stream.is_alive():
            error = json.loads(stream.body)["error"]
            assert error["code"] == "model_overloaded" and f"{tier}-priority" in error["message"], error
    stop_all(running)
    for stream in offers:  # the waiting ones are served once the places are free
        stream.join(300)
        if stream.status == 503:
            continue
        assert stream.status == 200 and stream.body.endswith(b"data: [DONE]\n\n"), stream.body[-300:]
    # What each key was charged: the refused requests nothing, and no slot is left.
    for tier in ("low", "normal", "high"):
        records = wait_until_settled(redis, tier_keys[tier][0])
        overloaded = [r for r in records if r["status"] == "overloaded"]
        assert len(overloaded) == 1 and overloaded[0]["total_tokens"] == "0", records


# -- fair share -------------------------------------------------------------------------


def test_a_light_keys_request_overtakes_a_heavy_keys_backlog(base_url, tier_keys, redis_server):
    heavy_id, heavy = create_key(redis_server.url, "fair-heavy", priority="high")
    light = create_key(redis_server.url, "fair-light", priority="high")[1]  # same tier: only the counters differ
    blocker = started(base_url, heavy, BLOCKER_TOKENS)  # the engine's one sequence
    # Three more wait in the engine (the replica's four places), three at the
    # gateway: the model's queue is 3 of 4.
    backlog = []
    try:
        for _ in range(TIERED_ONGOING - 1 + 3):
            backlog.append(started(base_url, heavy, 20, wait_for_first_chunk=False))
            time.sleep(0.1)
        at_replica(TIERED, TIERED_ONGOING)
        admitted(redis_server.url, heavy_id, 1 + len(backlog))  # the other three wait at the gateway
        _light_overtakes(base_url, light, blocker, backlog)
    finally:
        stop_all([blocker, *backlog])


def _light_overtakes(base_url, light, blocker, backlog) -> None:
    late = started(base_url, light, 20, wait_for_first_chunk=False)
    time.sleep(0.5)
    early = [(stream.status, stream.body[-200:]) for stream in (*backlog, late) if stream.first_chunk.is_set()]
    assert not early, early  # all still wait
    blocker.stop()
    for stream in (*backlog, late):
        stream.join(300)
        assert stream.status == 200 and stream.body.endswith(b"data: [DONE]\n\n"), stream.body[-300:]
    finished = sorted([*backlog, late], key=lambda stream: stream.ended_at)
    # First come, first served would run it last (index 6). Its counter was lifted to
    # the heavy key's (no credit for being new); on a tie the key whose last turn is
    # oldest goes first, and the heavy key is also charged what its blocker streamed:
    # the light request is the first out of the gateway's four (allowing one heavy
    # ahead of it for timing: the blocker is charged when the gateway's relay of it ends).
    order = [("light" if stream is late else "heavy") for stream in finished]
    assert finished.index(late) in (TIERED_ONGOING - 1, TIERED_ONGOING), order


def test_a_key_with_nothing_in_flight_starts_at_once_on_the_kept_place(base_url, redis_server):
    """The fair model has two places, one kept for keys with nothing in flight: a
    heavy key's second request waits at the gateway while its first runs, and a
    light key's request starts beside it at once (first come, first served, or a
    gate without the kept place, would hand the second place to the heavy key and
    make the light one wait for the blocker to end)."""
    heavy = create_key(redis_server.url, "kept-heavy", priority="high")[1]
    light = create_key(redis_server.url, "kept-light", priority="high")[1]
    deadline = time.monotonic() + 600
    while _chat(base_url, heavy, 1, model=FAIR).status_code != 200:  # the fair model is up
        assert time.monotonic() < deadline
        time.sleep(2)
    blocker = started(base_url, heavy, BLOCKER_TOKENS, model=FAIR)
    queued = started(base_url, heavy, 20, wait_for_first_chunk=False, model=FAIR)
    time.sleep(1.0)
    assert not queued.first_chunk.is_set()  # the second place is kept: the heavy key waits
    newcomer = started(base_url, light, 20, wait_for_first_chunk=False, model=FAIR)
    assert newcomer.first_chunk.wait(60), newcomer.body[-300:]  # beside the blocker, in the engine's batch
    newcomer.join(60)
    assert newcomer.status == 200 and newcomer.body.endswith(b"data: [DONE]\n\n"), newcomer.body[-300:]
    assert not queued.first_chunk.is_set() and blocker.is_alive()  # the heavy key's second still waits
    blocker.stop()
    queued.join(300)
    assert queued.status == 200 and queued.body.endswith(b"data: [DONE]\n\n"), queued.body[-300:]


def test_a_cache_affinity_replica_tells_the_routers_what_its_engine_holds(base_url, redis_server):
    """The fair model routes by what replicas hold (``cache_affinity``): its replica's vLLM
    engine publishes KV-cache events, and the replica hands Serve's routers the router's
    block hashes of what the engine holds (replicas/kv_events.py), through Serve's
    routing stats. A prompt sent unary and one streamed through the SDK are both held
    there, from their start; a prompt never sent is not."""
    from contract.model_config import RoutingSettings
    from contract.prompt_blocks import CACHED_BLOCKS, block_hashes, prompt_text

    block_chars = RoutingSettings().block_chars  # the fair model's (its default)

    key_id, secret = create_key(redis_server.url, "held-blocks", priority="high")
    salt = cache_salt(redis_server.url, "key:" + key_id)  # what the replica hashes with the prompt
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=300)

    def held() -> frozenset:  # what Serve's controller asks it every held_period_s
        return call_replica(FAIR, "record_routing_stats")[CACHED_BLOCKS]

    def leading(hashes: list[bytes]) -> int:
        published, count = held(), 0
        while count < len(hashes) and hashes[count] in published:
            count += 1
        return count

    def messages(n: int) -> list[dict]:
        return [
            {"role": "system", "content": f"Held application {n}. " + "Cite the policy, never promise refunds. " * 40},
            {"role": "user", "content": "Where is my parcel?"},
        ]

    deadline = time.monotonic() + 600
    while _chat(base_url, secret, 1, model=FAIR).status_code != 200:  # the fair model is up
        assert time.monotonic() < deadline
        time.sleep(2)
    client.chat.completions.create(model=FAIR, messages=messages(1), max_tokens=2)
    for _ in client.chat.completions.create(model=FAIR, messages=messages(2), max_tokens=2, stream=True):
        pass
    for n in (1, 2):
        hashes = block_hashes(prompt_text({"messages": messages(n), "cache_salt": salt}), block_chars)
        # Its whole engine blocks (128 tokens; the partial last one is not cached): most of it.
        while leading(hashes) < len(hashes) // 2:
            assert time.monotonic() < deadline, (n, leading(hashes), len(hashes))
            time.sleep(0.5)
    never = block_hashes(prompt_text({"messages": messages(3), "cache_salt": salt}), block_chars)
    assert not held() & set(never)
    # Nor the same prompts under another tenant's salt: what one tenant cached is its own.
    other = cache_salt(redis_server.url, "key:someone-else")
    assert not held() & set(block_hashes(prompt_text({"messages": messages(1), "cache_salt": other}), block_chars))
