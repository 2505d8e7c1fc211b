"""Which replica of a model takes a request: prefix affinity (or cache affinity,
``CacheAffinityRouter`` at the end) with a load guard.

A Ray Serve request router (``request_router_config`` on a model's deployment,
contract/model_config.py ``routing``); it runs in each ingress replica, inside
the handle that calls the model.

Requests whose prompts start alike go to the same replica, so vLLM's prefix
cache serves the shared part (a long system prompt, a few-shot template, a
conversation's earlier turns) instead of recomputing it. The replica is chosen by
rendezvous hashing of the prompt's first ``prefix_chars`` characters over the
running replicas' ids:

- no index to keep: memory stays constant however many prompts pass (Ray's
  PrefixCacheAffinityRouter keeps a prefix tree in a detached actor, unbounded
  unless eviction is switched on, asks it with a blocking ``ray.get`` on every
  routing decision, and cannot read our replica calls' arguments, which are a
  plain body dict);
- every ingress replica picks the same replica for the same prefix, with no
  shared state;
- a replica added or removed moves only the prefixes it wins or held.

The load guard: the preferred replica is taken while it runs at most
``imbalance_threshold`` more requests than the least busy replica; beyond that
the request goes to the less busy of two random replicas (Serve's default), which
then caches the prefix too. So a hot prefix spreads instead of queueing on one
replica, and an idle replica is never skipped for long.

A request naming a session (the client's ``x-session-id`` header, passed as Serve's
``session_id``) is placed by its session id instead of its prompt, within the same
guard: every turn of one conversation goes to one replica whatever its prompt starts
with (the edge does the same on a direct route: cluster/haproxy_edge.py).

LoRA adapters (Serve multiplexing): among the replicas that hold the adapter,
the same prefix choice and the same guard: a hot adapter overflows to the least
busy replicas, which load it, instead of queueing where it was first loaded.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Container, Mapping
from typing import TYPE_CHECKING

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from contract.prompt_blocks import CACHED_BLOCKS, MAX_HASHED_CHARS, block_hashes, prompt_text
from contract.replica_wire import AVOID
from serve_app.ray_private import (
    PowerOfTwoChoicesRequestRouter,
    cached_queue_len,
    probe_queue_lens,
    replicas_holding,
    router_deployment_name,
)

# By reference (Serve pickles this module by value, not the modules it imports).
from serve_app.routing import outliers, places
from serve_app.routing.block_index import BlockIndex
from serve_app.routing.policies import SESSION_KEY, ChosenNotSent, affine_choice, cached_choice, rendezvous_order

# What the mixin below extends, for the type checker only: at run time it is a plain mixin,
# placed before Serve's router classes in each router's bases.
if TYPE_CHECKING:
    _Router = RequestRouter
else:
    _Router = object


class PublishesPlaces(_Router):
    """Router mixin: publishes the deployment's places (places.py) whenever its replicas change."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        places.publish_places(router_deployment_name(self), sum(r.max_ongoing_requests for r in replicas))


class SkipsFailing(_Router):
    """Router mixin: the candidates less the replicas this process' gateway ejected
    (outliers.py) and those the call names in its ``avoid`` keyword (replicas that
    failed it already), unless that leaves none; and each accepted call's replica
    told to the gateway (``outliers.taken_by``), which judges the outcome."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kept = candidate_replicas
        avoid = pending_request.kwargs.get(AVOID, ()) if pending_request is not None else ()
        if avoid:
            kept = [replica for replica in kept if replica.replica_id.unique_id not in avoid] or kept
        ejector = outliers.ejector_of(router_deployment_name(self))
        if ejector is not None and kept:
            allowed = set(ejector.choices([replica.replica_id.unique_id for replica in kept]))
            kept = [replica for replica in kept if replica.replica_id.unique_id in allowed]
        return await super().choose_replicas(kept, pending_request)  # type: ignore[safe-super]  # a mixin

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ejector = outliers.ejector_of(router_deployment_name(self))
        if ejector is not None:
            ejector.forget_others([replica.replica_id.unique_id for replica in replicas])

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        outliers.taken_by(result, replica_id.unique_id)


class PowerOfTwoRouter(SkipsFailing, PublishesPlaces, PowerOfTwoChoicesRequestRouter):
    """Serve's default router (``routing.policy: power_of_two``), publishing places."""


class PrefixAffinityChoice(PublishesPlaces, LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's power-of-two choice with prefix (and adapter) affinity in front.

    Not a subclass of PowerOfTwoChoicesRequestRouter: its FIFOMixin hands the
    replica chosen for one request to the oldest waiting request, which has
    another prefix. Without it, Serve gives each request the replica chosen for it.
    """

    # Serve's own choice (adapter holders, then locality, then two at random),
    # for requests with no prompt and adapters no replica holds yet.
    _power_of_two = PowerOfTwoChoicesRequestRouter.choose_replicas

    def __init__(self, *args, **kwargs):
        self._chosen_not_sent = ChosenNotSent()
        self._probed_at: dict[str, float] = {}  # when each replica's count was last asked (ChosenNotSent)
        super().__init__(*args, **kwargs)

    # Serve calls it with the config's request_router_kwargs: named here, as the config names them.
    def initialize_state(self, prefix_chars: int = 512, imbalance_threshold: int = 4) -> None:  # type: ignore[override]
        self._prefix_chars = prefix_chars
        self._imbalance_threshold = imbalance_threshold

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        running = {replica.replica_id.unique_id for replica in replicas}
        self._chosen_not_sent.forget_others(running)
        self._probed_at = {rid: at for rid, at in self._probed_at.items() if rid in running}

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)  # Serve's cache counts it from now on
        self._chosen_not_sent.sent(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return await self._power_of_two(candidate_replicas, pending_request)  # type: ignore[misc]
        has_body = len(pending_request.args) >= 2  # call(operation, body)
        text = prompt_text(pending_request.args[1], self._text_chars()) if has_body else ""
        session = pending_request.metadata.session_id
        if not (text or session):
            return await self._power_of_two(candidate_replicas, pending_request)  # type: ignore[misc]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        holders = self._adapter_holders(by_id, pending_request)
        if not holders:  # an adapter nobody holds yet: Serve's choice (fewest adapters loaded)
            return await self._power_of_two(candidate_replicas, pending_request)  # type: ignore[misc]
        queue_lens = await self._queue_lens(candidate_replicas)
        if session:
            chosen = self._choose_session(session, text, holders, queue_lens)
        else:
            chosen = self._choose(text, holders, queue_lens)
        if chosen is None:  # imbalanced: the less busy of two random replicas, adapter or not
            two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            # Less busy first: a pick without a reservation (the edge router's) takes the first.
            return [sorted(two, key=lambda replica: queue_lens[replica.replica_id.unique_id])]
        self._chosen_not_sent.add(chosen)
        # The chosen replica first; if its queue is full, the least busy of the rest.
        rest = [by_id[rid] for rid in by_id if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def _text_chars(self) -> int:
        """How much of the prompt the choice reads."""
        return self._prefix_chars

    def _choose(self, text: str, holders: list[str], queue_lens: dict[str, int]) -> str | None:
        """The replica for a prompt starting with ``text`` among ``holders``; None past the guard."""
        return affine_choice(rendezvous_order(text, holders), queue_lens, self._imbalance_threshold)

    def _choose_session(self, session: str, text: str, holders: list[str], queue_lens: dict[str, int]) -> str | None:
        """A session's requests (the client's session header: one conversation, whose
        history its replica has cached) on one replica, by rendezvous hashing of its
        id, within the same load guard; None past it."""
        return affine_choice(rendezvous_order(SESSION_KEY + session, holders), queue_lens, self._imbalance_threshold)

    def _adapter_holders(self, by_id: Mapping[str, RunningReplica], pending_request: PendingRequest) -> list[str]:
        """The candidates that may take it: all of them, or for a LoRA adapter (Serve
        multiplexing) those that hold it (none: nobody has loaded it yet)."""
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter:
            return list(by_id)
        held = replicas_holding(self, adapter)
        return [rid for rid in by_id if rid in held]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests each replica runs, from Serve's queue-length cache, probing
        the replicas it has no fresh entry for, plus the requests this router
        chose it for that are not sent yet.

        When those counts are past the load guard and this router's own picks since
        its replicas were last asked are part of them (the edge router's: it never
        learns when they end), the replicas with such picks are asked again first: one
        client's requests one after another, faster than the probes, are not a flood."""
        lens, picks = await self._counts(replicas)
        counts = {rid: (length or 0) + picks[rid] for rid, length in lens.items()}
        if any(picks.values()) and max(counts.values()) - min(counts.values()) > self._imbalance_threshold:
            lens, picks = await self._counts(replicas, ask={rid for rid, n in picks.items() if n})
            counts = {rid: (length or 0) + picks[rid] for rid, length in lens.items()}
        return counts

    async def _counts(
        self, replicas: list[RunningReplica], ask: Container[str] = frozenset()
    ) -> tuple[dict[str, int | None], dict[str, int]]:
        """Each replica's count (cached, or probed if stale or in ``ask``; None: no
        answer) and this router's picks of it that count has not seen."""
        lens: dict[str, int | None] = {}
        unknown = []
        for replica in replicas:
            cached = cached_queue_len(self, replica) if replica.replica_id.unique_id not in ask else None
            if cached is None:
                unknown.append(replica)
            lens[replica.replica_id.unique_id] = cached
        if unknown:
            asked = self._chosen_not_sent.now()
            for replica, queue_len in await probe_queue_lens(self, unknown):
                lens[replica.replica_id.unique_id] = queue_len
                if queue_len is not None:
                    self._probed_at[replica.replica_id.unique_id] = asked
        return lens, {rid: self._chosen_not_sent.count(rid, self._probed_at.get(rid)) for rid in lens}


class PrefixAffinityRouter(SkipsFailing, PrefixAffinityChoice):
    """The prefix-affinity choice (``routing.policy: prefix_affinity``, the default)
    among the replicas that are not failing."""


class CacheAffinityRouter(PrefixAffinityRouter):
    """Routes on what each replica holds (``routing.policy: cache_affinity``): the
    replica with the longest cached run of the whole prompt (block_index.py), within
    the load guard. What a replica holds is what its engine says (its KV-cache events,
    translated by the replica into the router's block hashes, replicas/kv_events.py,
    handed here in Serve's routing stats) plus what this router sent it in the last
    ``trust_own_s``; for a replica that publishes nothing, whatever it was sent. So a conversation follows its own
    history, which grows with every
    turn, instead of its application's shared system prompt; and once a hot system
    prompt has spilled past the guard onto several replicas, new conversations that
    share it go to the least busy of them. Adapters: among their holders, as the
    prefix router does. A prompt none of the eligible replicas holds goes where the
    prefix router would send it, so ingress replicas agree on it."""

    def initialize_state(  # type: ignore[override]
        self,
        prefix_chars: int = 512,
        imbalance_threshold: int = 4,
        block_chars: int = 256,
        max_blocks: int = 100_000,
        trust_own_s: float = 30.0,
    ) -> None:
        super().initialize_state(prefix_chars, imbalance_threshold)
        self._block_chars = block_chars
        self._trust_own_s = trust_own_s
        self._index = BlockIndex(max_blocks)
        self._replica_ids: set[str] = set()
        # What each replica's engine says it holds (replicas/kv_events.py, Serve's routing
        # stats); a replica absent publishes nothing.
        self._published: dict[str, Collection[bytes]] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        running = {replica.replica_id.unique_id for replica in replicas}
        if running != self._replica_ids:  # routing stats come often; the index pass only when replicas change
            self._index.forget_others(running)
            self._replica_ids = running
        self._published = {}
        for replica in replicas:
            held = (replica.routing_stats or {}).get(CACHED_BLOCKS)
            if isinstance(held, (frozenset, set)):
                self._published[replica.replica_id.unique_id] = held

    def _text_chars(self) -> int:
        return MAX_HASHED_CHARS  # the whole prompt, up to the index's bound

    def _choose_session(self, session: str, text: str, holders: list[str], queue_lens: dict[str, int]) -> str | None:
        chosen = super()._choose_session(session, text, holders, queue_lens)
        if chosen is not None and text:  # the index learns where the conversation runs
            self._index.record(block_hashes(text, self._block_chars), chosen)
        return chosen

    def _choose(self, text: str, holders: list[str], queue_lens: dict[str, int]) -> str:
        hashes = block_hashes(text, self._block_chars)
        order = rendezvous_order(text[: self._prefix_chars], holders)
        matched = self._index.matched(hashes, holders, self._published, self._trust_own_s)
        chosen = cached_choice(order, matched, queue_lens, self._imbalance_threshold)
        if chosen is None:  # every holder past the guard: the least busy replica of all (it will hold it)
            chosen = min(queue_lens, key=lambda rid: (queue_lens[rid], rid))
        # Where it runs unless that replica's queue is full; then the least busy of the
        # rest, which the index does not learn (rare: the guard keeps queues level).
        self._index.record(hashes, chosen)
        return chosen
