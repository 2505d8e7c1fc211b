"""The cache-affinity router's index (serve_app/routing/block_index.py) and its
decisions (serve_app/routing/serve_routers.py CacheAffinityRouter), with Serve's replica
wrappers faked as in test_routing.py: what a replica is taken to hold, how the
longest held run wins within the load guard, and that the index stays bounded."""

import pytest
from test_routing import FakeReplica, chat, ids, pending, queue

from contract.model_config import CACHE_AFFINITY_ROUTER, ModelConfig
from contract.prompt_blocks import MAX_HASHED_CHARS, block_hashes, prompt_text
from serve_app.routing.block_index import BlockIndex
from serve_app.routing.policies import cached_choice, prompt_prefix, rendezvous_order

SYSTEM = "You are the support agent of ACME; answer briefly. " * 30  # ~1,500 characters, shared


def conversation(name: str, turns: int) -> dict:
    """An agent conversation: the shared system prompt, then its own turns."""
    messages = [("system", SYSTEM)]
    for turn in range(turns):
        messages += [
            ("user", f"{name} asks question {turn}: " + "details " * 40),
            ("assistant", f"answer {turn} for {name} " * 20),
        ]
    return chat(*messages)


def test_block_hashes_chain_so_a_match_means_the_same_prompt_up_to_it():
    a = block_hashes("x" * 256 + "y" * 256 + "z" * 100, 256)
    b = block_hashes("x" * 256 + "w" * 256, 256)
    assert len(a) == 2 and len(b) == 2  # whole blocks only: the partial tail changes with every token
    assert a[0] == b[0] and a[1] != b[1]
    # The same block after a different start is another block.
    assert block_hashes("q" * 256 + "y" * 256, 256)[1] != a[1]


def test_prompt_text_is_bounded_and_reads_what_the_prefix_router_reads():
    body = chat(("system", "s" * 100_000), ("user", "hi"))
    assert len(prompt_text(body)) == MAX_HASHED_CHARS
    assert prompt_text(body, 512) == prompt_prefix(body, 512)
    assert len(block_hashes(prompt_text(body), 256)) == MAX_HASHED_CHARS // 256
    for odd in (None, 5, "text", [1, 2], {"messages": "nope"}, {"messages": [None, 3, {"content": {"x": 1}}]}):
        assert isinstance(prompt_text(odd), str)


def test_the_index_counts_the_leading_blocks_each_replica_holds():
    index = BlockIndex()
    first = block_hashes(prompt_text(conversation("ann", 1)), 256)
    second = block_hashes(prompt_text(conversation("ann", 2)), 256)
    other = block_hashes(prompt_text(conversation("bob", 1)), 256)
    index.record(first, "a")
    index.record(other, "b")
    matched = index.matched(second, ["a", "b", "c"])
    # ann's second turn: all of her first turn on a; only the shared system prompt on b.
    assert matched["a"] == len(first)  # the first turn's text is the start of the second's
    assert 0 < matched["b"] < matched["a"] and matched["c"] == 0


def test_the_index_is_bounded_and_forgets_replicas_that_are_gone():
    index = BlockIndex(max_blocks=1_000)
    for n in range(200):
        index.record(block_hashes(prompt_text(conversation(f"user-{n}", 3)), 256), f"r{n % 3}")
    assert len(index) == 1_000
    recent = block_hashes(prompt_text(conversation("user-199", 3)), 256)
    assert index.matched(recent, ["r1"])["r1"] == len(recent)  # the most recent survive
    index.forget_others({"r0", "r2"})
    assert index.matched(recent, ["r1"])["r1"] == 0 and len(index) < 1_000


def test_the_longest_held_run_wins_within_the_guard_then_the_least_busy():
    order = ["a", "b", "c"]
    idle = {"a": 0, "b": 0, "c": 0}
    assert cached_choice(order, {"a": 0, "b": 0, "c": 0}, idle, 4) == "a"  # nothing held: the prefix order
    assert cached_choice(order, {"a": 3, "b": 7, "c": 0}, idle, 4) == "b"
    assert cached_choice(order, {"a": 3, "b": 7, "c": 0}, {"a": 0, "b": 5, "c": 0}, 4) == "a"  # b past the guard
    assert cached_choice(order, {"a": 3, "b": 3, "c": 0}, {"a": 2, "b": 1, "c": 0}, 4) == "b"  # equals: least busy
    assert cached_choice(order, {"a": 3}, {"a": 9, "b": 0, "c": 0}, 4) == "b"  # held only past the guard
    assert cached_choice([], {}, {}, 4) is None


def test_models_may_route_by_what_replicas_hold():
    options = ModelConfig(name="m", routing={"policy": "cache_affinity", "block_chars": 128}).serve_options()
    config = options["request_router_config"]
    assert config["request_router_class"] == CACHE_AFFINITY_ROUTER
    assert config["request_routing_stats_period_s"] == 2.0  # what the engines hold, handed to the routers
    assert config["request_router_kwargs"] == {
        "prefix_chars": 512,
        "imbalance_threshold": 4,
        "block_chars": 128,
        "max_blocks": 100_000,
    }
    with pytest.raises(ValueError):
        ModelConfig(name="m", routing={"policy": "cache_affinity", "block_chars": 0})


def cache_router(*replicas):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from serve_app.routing.serve_routers import CacheAffinityRouter

    router = CacheAffinityRouter(
        deployment_id=DeploymentID("model-m", "llm"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(prefix_chars=512, imbalance_threshold=4, block_chars=256, max_blocks=10_000)
    router._replicas = {r.replica_id: r for r in replicas}
    router._replica_id_set = set(router._replicas)
    router._update_multiplexed_model_ids_with_replicas(list(replicas))
    return router


def sent(router, replica):
    """Serve sent the chosen request there and it ended (the replica's count back down)."""
    router.on_send_request(replica.replica_id)
    queue(router, replica, 0)


async def test_each_conversation_follows_its_own_history_not_its_applications_system_prompt():
    """Every conversation of one application starts with the same system prompt: the
    prefix router would put all of them on one replica. Here the first conversation
    goes where that prompt ranks first; once that replica is past the guard the next
    one spills, and from then on every turn of every conversation goes back to the
    replica that holds its history, while new ones go to the least busy holder."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = cache_router(a, b)
    replicas = {"a": a, "b": b}
    for replica in (a, b):
        queue(router, replica, 0)
    first = rendezvous_order(prompt_prefix(conversation("c0", 1), 512), ["a", "b"])[0]
    second = "b" if first == "a" else "a"
    # A burst of 6 new conversations: 5 on the first (the guard, 4 ahead of an idle replica), then a spill.
    homes = {}
    for n in range(6):
        homes[f"c{n}"] = ids(await router.choose_replicas([a, b], pending(conversation(f"c{n}", 1))))[0][0]
    assert [homes[f"c{n}"] for n in range(6)] == [first] * 5 + [second]
    for rid in ("a", "b"):
        for _ in range(list(homes.values()).count(rid)):
            sent(router, replicas[rid])
    # Their next turns, the replicas idle again: each conversation goes home.
    for name, home in homes.items():
        assert ids(await router.choose_replicas([a, b], pending(conversation(name, 2))))[0][0] == home
        sent(router, replicas[home])
    # A new conversation: both hold the system prompt; the less busy one takes it.
    queue(router, replicas[first], 3)
    assert ids(await router.choose_replicas([a, b], pending(conversation("new", 1))))[0][0] == second
    # A conversation whose home is past the guard goes to the other replica (which then holds it).
    queue(router, replicas[first], 9)
    assert ids(await router.choose_replicas([a, b], pending(conversation("c0", 3))))[0][0] == second


async def test_a_request_without_a_prompt_and_an_unheld_adapter_use_serves_choice():
    a, b = FakeReplica("a"), FakeReplica("b", adapters=["pirate"])
    router = cache_router(a, b)
    queue(router, a, 0)
    queue(router, b, 0)
    ranks = ids(await router.choose_replicas([a, b], pending({"input": "embed me"})))
    assert len(ranks) == 1 and sorted(ranks[0]) == ["a", "b"]
    # An adapter goes to its holder; one nobody holds, to Serve's multiplexing choice.
    assert ids(await router.choose_replicas([a, b], pending(conversation("p", 1), "pirate")))[0] == ["b"]
    assert all(ids(await router.choose_replicas([a, b], pending(conversation("p", 1), "parrot"))))


def test_what_an_engine_publishes_outranks_the_routers_own_records_once_they_are_old():
    now = [0.0]
    index = BlockIndex(clock=lambda: now[0])
    hashes = block_hashes(prompt_text(conversation("ann", 2)), 256)
    index.record(hashes, "a")
    index.record(hashes, "b")
    # a publishes what its engine holds (nothing yet: its prompt still runs); b publishes nothing.
    published = {"a": frozenset()}
    now[0] = 10.0
    assert index.matched(hashes, ["a", "b"], published, trust_own_s=30) == {"a": len(hashes), "b": len(hashes)}
    now[0] = 40.0  # past the trust: a holds what its engine says; b what was sent to it
    assert index.matched(hashes, ["a", "b"], published, trust_own_s=30) == {"a": 0, "b": len(hashes)}
    published = {"a": frozenset(hashes[:3])}
    assert index.matched(hashes, ["a"], published, trust_own_s=30) == {"a": 3}
    # What it published and what was sent to it since join up.
    index.record(hashes, "a")
    assert index.matched(hashes, ["a"], published, trust_own_s=30) == {"a": len(hashes)}
    # A replica's engine may hold what this router never sent it (another router did).
    other = block_hashes(prompt_text(conversation("bob", 1)), 256)
    assert index.matched(other, ["c"], {"c": frozenset(other)}, trust_own_s=30) == {"c": len(other)}


class PublishingReplica:
    """A fake replica that publishes what its engine holds (Serve's routing stats)."""

    def __new__(cls, unique_id: str, held=None):
        from test_routing import FakeReplica

        from contract.prompt_blocks import CACHED_BLOCKS

        replica = FakeReplica(unique_id)
        replica.routing_stats = {CACHED_BLOCKS: frozenset(held or ())} if held is not None else {}
        return replica


async def test_a_conversation_goes_where_an_engine_says_it_is_held_though_this_router_never_sent_it():
    """Another router (another ingress replica, the edge router) sent a conversation's
    first turn to b: this router learns it from b's published hashes and sends the next
    turn there, not where the system prompt ranks first; once b's engine evicted it, its
    prompt goes where the prefix router would send it."""
    turn1 = conversation("carol", 1)
    first = rendezvous_order(prompt_prefix(turn1, 512), ["a", "b"])[0]
    other = "b" if first == "a" else "a"
    holds = {
        first: PublishingReplica(first, held=()),
        other: PublishingReplica(other, held=block_hashes(prompt_text(turn1), 256)),
    }
    router = cache_router(*holds.values())
    router.update_replicas(list(holds.values()))
    for replica in holds.values():
        queue(router, replica, 0)
    replicas = list(holds.values())
    assert ids(await router.choose_replicas(replicas, pending(conversation("carol", 2))))[0][0] == other
    evicted = [PublishingReplica(first, held=()), PublishingReplica(other, held=())]
    router.update_replicas(evicted)
    router._trust_own_s = 0  # this router's own record of the second turn is old news
    assert ids(await router.choose_replicas(evicted, pending(conversation("carol", 2))))[0][0] == first
