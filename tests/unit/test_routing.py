"""Prefix affinity's pure parts (serve_app/routing/serve_routers.py): what part of a request
decides, how replicas are ranked for it, and when load overrides it. The router
itself runs under real Serve in tests/e2e/test_scheduling_e2e.py."""

import collections
import random
import string
import time

import pytest

from contract.model_config import POWER_OF_TWO_ROUTER, PREFIX_AFFINITY_ROUTER, ModelConfig
from serve_app.routing.policies import ChosenNotSent, affine_choice, prompt_prefix, rendezvous_order

SYSTEM = "You are a support agent for ACME. " * 40  # ~1,400 characters, as shared system prompts are


def chat(*turns: tuple[str, object]) -> dict:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in turns]}


def test_requests_sharing_a_system_prompt_share_their_prefix():
    a = prompt_prefix(chat(("system", SYSTEM), ("user", "Where is my parcel?")), 512)
    b = prompt_prefix(chat(("system", SYSTEM), ("user", "Cancel my order")), 512)
    assert a == b and len(a) == 512


def test_roles_and_message_boundaries_count():
    """The same words in other roles or split otherwise are another prompt to the engine."""
    assert prompt_prefix(chat(("system", "ab")), 64) != prompt_prefix(chat(("user", "ab")), 64)
    assert prompt_prefix(chat(("user", "a"), ("user", "b")), 64) != prompt_prefix(chat(("user", "ab")), 64)


def test_short_prompts_are_whole_and_content_parts_are_read():
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert "describe" in prompt_prefix(chat(("user", parts)), 512)
    assert prompt_prefix({"prompt": "Once upon a time"}, 512) == "Once upon a time"
    assert prompt_prefix({"prompt": ["first prompt", "second"]}, 5) == "first"
    assert prompt_prefix({"prompt": [1, 2, 3]}, 512) == "1,2,3"


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "text",
        {"messages": "x"},
        {"messages": [1, None, {"role": 5}]},
        {"prompt": None},
        {"prompt": [[]]},
        {"prompt": {"a": 1}},
        {"input": "embed me"},
    ],
)
def test_odd_bodies_give_a_prefix_or_nothing_and_never_raise(body):
    assert isinstance(prompt_prefix(body, 512), str)


def test_a_prefix_ranks_replicas_the_same_everywhere_and_spreads_over_replicas():
    replicas = [f"replica-{i}" for i in range(4)]
    firsts = collections.Counter()
    for n in range(2000):
        prefix = f"template {n}"
        order = rendezvous_order(prefix, replicas)
        assert sorted(order) == replicas
        assert rendezvous_order(prefix, list(reversed(replicas))) == order  # no dependence on listing order
        firsts[order[0]] += 1
    assert all(400 < count < 600 for count in firsts.values()), firsts


def test_removing_a_replica_moves_only_the_prefixes_it_held():
    replicas = [f"replica-{i}" for i in range(4)]
    prefixes = ["".join(random.Random(n).choices(string.ascii_letters, k=40)) for n in range(1000)]
    before = {p: rendezvous_order(p, replicas)[0] for p in prefixes}
    after = {p: rendezvous_order(p, replicas[:3])[0] for p in prefixes}
    moved = [p for p in prefixes if before[p] != after[p]]
    assert moved and all(before[p] == "replica-3" for p in moved)


def test_the_preferred_replica_is_kept_until_it_is_past_the_guard():
    order = ["a", "b", "c"]
    assert affine_choice(order, {"a": 6, "b": 2, "c": 2}, imbalance_threshold=4) == "a"
    assert affine_choice(order, {"a": 7, "b": 2, "c": 3}, imbalance_threshold=4) == "b"  # next in its order
    assert affine_choice(order, {"a": 7, "b": 7, "c": 2}, imbalance_threshold=4) == "c"
    assert affine_choice(["a", "b"], {"a": 9, "b": 9, "c": 0}, imbalance_threshold=4) is None  # holders all busy
    assert affine_choice(order, {"a": None, "b": None, "c": None}, imbalance_threshold=0) == "a"
    assert affine_choice([], {"a": 0}, imbalance_threshold=4) is None


def test_models_route_by_prefix_unless_configured_otherwise():
    options = ModelConfig(name="m").serve_options()
    assert options["request_router_config"]["request_router_class"] == PREFIX_AFFINITY_ROUTER
    assert options["request_router_config"]["request_router_kwargs"] == {"prefix_chars": 512, "imbalance_threshold": 4}
    power_of_two = ModelConfig(name="m", routing={"policy": "power_of_two"}).serve_options()
    assert power_of_two["request_router_config"] == {"request_router_class": POWER_OF_TWO_ROUTER}
    with pytest.raises(ValueError):
        ModelConfig(name="m", routing={"prefix_chars": 0})
    with pytest.raises(ValueError):
        ModelConfig(name="m", routing={"policy": "random"})


# -- the router's decisions, with Serve's replica wrappers faked ------------------------


class FakeReplica:
    """What the router reads of a running replica (RunningReplica's attributes)."""

    def __init__(self, unique_id: str, adapters=()):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id, DeploymentID("model-m", "llm"))
        self.multiplexed_model_ids = set(adapters)
        self.max_ongoing_requests = 16
        self.node_id, self.availability_zone = "node", None
        self.running = 0  # what a probe of its queue length answers

    async def get_queue_len(self, deadline_s: float) -> int:
        return self.running


def router_with(*replicas):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.routing.serve_routers import PrefixAffinityRouter

    router = PrefixAffinityRouter(
        deployment_id=DeploymentID("model-m", "llm"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(prefix_chars=512, imbalance_threshold=4)
    # What update_replicas keeps, without its probes of the replicas.
    router._replicas = {r.replica_id: r for r in replicas}
    router._replica_id_set = set(router._replicas)
    router._update_multiplexed_model_ids_with_replicas(list(replicas))
    return router


def queue(router, replica, length):
    """``replica`` runs ``length`` requests: what Serve's cache holds and a probe answers."""
    router._replica_queue_len_cache.update(replica.replica_id, length)
    replica.running = length


def pending(body, adapter=""):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(
        args=["chat", body], kwargs={}, metadata=RequestMetadata("r", "i", multiplexed_model_id=adapter)
    )


def ids(ranks):
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def test_the_router_prefers_the_prefix_replica_then_the_rest_and_balances_past_the_guard():
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    router = router_with(a, b, c)
    body = chat(("system", SYSTEM), ("user", "hi"))
    order = rendezvous_order(prompt_prefix(body, 512), ["a", "b", "c"])
    for replica in (a, b, c):
        queue(router, replica, 0)
    ranks = ids(await router.choose_replicas([a, b, c], pending(body)))
    assert ranks[0] == [order[0]] and sorted(ranks[1]) == sorted(order[1:])
    by_id = {"a": a, "b": b, "c": c}
    queue(router, by_id[order[0]], 5)
    ranks = ids(await router.choose_replicas([a, b, c], pending(body)))
    assert ranks[0] == [order[1]]  # the first is 5 ahead of the least busy: the next in the prefix's order


async def test_all_replicas_past_the_guard_and_no_prompt_fall_back_to_two_choices():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    queue(router, a, 0)
    queue(router, b, 0)
    ranks = ids(await router.choose_replicas([a, b], pending({"input": "embed me"})))
    assert len(ranks) == 1 and sorted(ranks[0]) == ["a", "b"]  # Serve's choice: both, least busy wins


async def test_an_adapter_prefers_its_holders_and_overflows_when_they_are_busy():
    holder, other = FakeReplica("holder", adapters=["pirate"]), FakeReplica("other")
    router = router_with(holder, other)
    queue(router, holder, 3)
    queue(router, other, 0)
    body = chat(("user", "ahoy"))
    assert ids(await router.choose_replicas([holder, other], pending(body, "pirate")))[0] == ["holder"]
    queue(router, holder, 9)  # a hot adapter: its holder far busier than the other replica
    ranks = ids(await router.choose_replicas([holder, other], pending(body, "pirate")))
    assert len(ranks) == 1 and sorted(ranks[0]) == ["holder", "other"]  # the less busy of the two takes it
    # An adapter nobody holds: Serve's multiplexing (fewest adapters loaded first).
    ranks = ids(await router.choose_replicas([holder, other], pending(body, "parrot")))
    assert ranks and all(rank for rank in ranks)


@pytest.mark.parametrize("router_class", [PREFIX_AFFINITY_ROUTER, POWER_OF_TWO_ROUTER])
async def test_either_router_publishes_the_deployments_places_where_the_gateway_reads_them(router_class):
    """What the fair-share queue fills before it holds requests back: the sum of the
    running replicas' max_ongoing_requests, kept as replicas come and go. The class
    is loaded as Serve loads it: pickled by value (a registry in the router's own
    module would be a copy the gateway never sees; an e2e run found the gate open)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.config import RequestRouterConfig

    from serve_app.routing import places

    router_cls = RequestRouterConfig(request_router_class=router_class).get_request_router_class()
    router = router_cls(
        deployment_id=DeploymentID("model-p", "llm"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state()
    assert places.replica_places("model-p") is None
    a, b = FakeReplica("a"), FakeReplica("b")
    router.update_replicas([a, b])
    assert places.replica_places("model-p") == 32
    router.update_replicas([b])
    assert places.replica_places("model-p") == 16
    places._PLACES.clear()


async def test_a_burst_chosen_before_any_is_sent_still_trips_the_guard():
    """The routing tasks of a burst choose before Serve sends any of them (so
    before Serve's cache counts them): the guard counts the router's own choices,
    and the sixth request of a burst on one prefix goes to the other replica."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    queue(router, a, 0)
    queue(router, b, 0)
    body = chat(("system", SYSTEM), ("user", "hi"))
    preferred, other = rendezvous_order(prompt_prefix(body, 512), ["a", "b"])
    firsts = [ids(await router.choose_replicas([a, b], pending(body)))[0] for _ in range(6)]
    assert firsts[:5] == [[preferred]] * 5  # at most the guard (4) ahead of the idle replica
    assert firsts[5] == [other]  # past the guard: the next replica in the prefix's order
    # Sent: Serve's cache now counts them and the router's own count ends.
    replica = {"a": a, "b": b}[preferred]
    for _ in range(5):
        router.on_send_request(replica.replica_id)
    assert router._replica_queue_len_cache.get(replica.replica_id) == 5
    assert router._chosen_not_sent.count(preferred) == 0


def test_a_choice_never_sent_stops_counting_after_its_time():
    from serve_app.routing.policies import ChosenNotSent

    now = [0.0]
    chosen = ChosenNotSent(ttl_s=2.0, clock=lambda: now[0])
    chosen.add("a")
    chosen.add("a")
    chosen.sent("b")  # another replica's send takes nothing from a's
    assert chosen.count("a") == 2
    now[0] = 1.0
    chosen.add("a")
    now[0] = 2.5  # the first two were dropped by Serve (cancelled, passed over)
    assert chosen.count("a") == 1
    chosen.forget_others({"b"})  # a's replica is gone
    assert chosen.count("a") == 0 and chosen._chosen == {}


def test_a_choice_never_sent_stops_counting_once_a_probe_of_its_replica_has_seen_it():
    """The edge router's picks go over HAProxy, never through Serve: each counts until
    its replica's own count was asked after the request reached it."""
    from serve_app.routing.policies import ChosenNotSent

    now = [10.0]
    chosen = ChosenNotSent(ttl_s=2.0, clock=lambda: now[0])
    chosen.add("a")
    now[0] = 10.2
    chosen.add("a")  # made just before the probe: maybe not at the replica yet
    assert chosen.count("a", probed_at=10.21) == 1
    assert chosen.count("a", probed_at=None) == 1
    now[0] = 10.3
    chosen.add("a")
    assert chosen.count("a", probed_at=10.3) == 1  # the probe at 10.3 saw the pick of 10.2, not this one's


async def test_at_the_edge_sequential_requests_on_one_prefix_stay_on_its_replica():
    """Picks never sent (the edge router's) once past: a fresh probe counts what still
    runs, so one client's requests one after another do not trip the guard."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    body = chat(("system", SYSTEM), ("user", "hi"))
    preferred = rendezvous_order(prompt_prefix(body, 512), ["a", "b"])[0]
    firsts = []
    for _ in range(8):
        router._replica_queue_len_cache.invalidate_key(a.replica_id)  # stale: asked again
        router._replica_queue_len_cache.invalidate_key(b.replica_id)
        firsts.append(ids(await router.choose_replicas([a, b], pending(body)))[0])
        time.sleep(ChosenNotSent.PROBE_LAG_S)  # the request ran and ended before the next
    assert firsts == [[preferred]] * 8


async def test_at_the_edge_picks_faster_than_the_probes_trip_the_guard_only_if_the_replica_is_busy():
    """Picks never sent, one after another faster than the cached counts expire: once
    the picks alone would trip the guard, the router asks the replica, which has ended
    them, and keeps the prefix there; a replica that does run that many is spread from."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    queue(router, a, 0)  # fresh in Serve's cache for the whole test: no probe on its own
    queue(router, b, 0)
    body = chat(("system", SYSTEM), ("user", "hi"))
    preferred, other = rendezvous_order(prompt_prefix(body, 512), ["a", "b"])
    firsts = []
    for _ in range(10):
        firsts.append(ids(await router.choose_replicas([a, b], pending(body)))[0])
        time.sleep(ChosenNotSent.PROBE_LAG_S)  # the request ran and ended before the next
    assert firsts == [[preferred]] * 10
    {"a": a, "b": b}[preferred].running = 6  # a flood on it now
    assert ids(await router.choose_replicas([a, b], pending(body)))[0] == [other]


def pending_in_session(body, session: str):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=["chat", body], kwargs={}, metadata=RequestMetadata("r", "i", session_id=session))


@pytest.mark.parametrize("policy", ["prefix", "cache"])
async def test_a_sessions_turns_go_to_one_replica_whatever_their_prompt_and_sessions_spread(policy):
    from test_block_index import cache_router, sent

    replicas = [FakeReplica(name) for name in "abc"]
    router = router_with(*replicas) if policy == "prefix" else cache_router(*replicas)
    for replica in replicas:
        queue(router, replica, 0)

    async def place(body, session):
        [chosen], *_ = await router.choose_replicas(replicas, pending_in_session(body, session))
        sent(router, chosen)
        return chosen.replica_id.unique_id

    # Every conversation of the application starts with its system prompt: by prefix they
    # would all share one replica; by session each keeps its own, turn after turn.
    placed = {}
    for i in range(30):
        first = await place(chat(("system", SYSTEM), ("user", f"question {i}")), f"conversation-{i}")
        later = await place(
            chat(("system", SYSTEM), ("user", f"question {i}"), ("assistant", "answer"), ("user", "and then?")),
            f"conversation-{i}",
        )
        assert later == first
        placed[i] = first
    assert set(placed.values()) == {"a", "b", "c"}
    # A session with no prompt (an embedding's input) is still placed by its session.
    assert await place({"input": "embed me"}, "conversation-0") == placed[0]
    # Past the load guard a session moves to the next replica in its own order.
    by_id = {r.replica_id.unique_id: r for r in replicas}
    queue(router, by_id[placed[0]], 9)
    moved = await place(chat(("user", "again")), "conversation-0")
    assert moved != placed[0]
    assert moved == rendezvous_order("session\x00conversation-0", [r for r in "abc" if r != placed[0]])[0]
