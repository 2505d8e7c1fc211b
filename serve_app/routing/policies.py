"""The routers' decisions as pure functions and classes: which replica a prompt or a
session prefers (rendezvous hashing), the load guard, the cached-run choice, and the
choices a router made that Serve has not sent yet. No Ray here: tests/unit/test_routing.py
and test_block_index.py drive them directly; serve_routers.py plugs them into Serve.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

from contract.prompt_blocks import prompt_text

# Session ids hash in a space of their own: one never lands where a prompt of the same text would.
SESSION_KEY = "session\x00"


def prompt_prefix(body: Any, chars: int) -> str:
    """The first ``chars`` characters of what the engine will read first: the
    messages' roles and text in order, or the prompt. '' when there is none
    (then nothing is gained by affinity)."""
    return prompt_text(body, chars)


def rendezvous_order(prefix: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` from most to least preferred for ``prefix``: each id's
    score is a hash of (prefix, id), so removing a replica changes the order of
    the others for no prefix."""
    digest = hashlib.blake2b(prefix.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return sorted(
        replica_ids, key=lambda rid: hashlib.blake2b(rid.encode(), key=digest, digest_size=8).digest(), reverse=True
    )


def affine_choice(order: Sequence[str], queue_lens: Mapping[str, int | None], imbalance_threshold: int) -> str | None:
    """The first replica of ``order`` that runs at most ``imbalance_threshold``
    more requests than the least busy replica, or None when every replica of
    ``order`` is past that (the caller then balances load). Unknown queue
    lengths count as 0 (the router probes them first)."""
    least = min((length or 0 for length in queue_lens.values()), default=0)
    for rid in order:
        if (queue_lens.get(rid) or 0) - least <= imbalance_threshold:
            return rid
    return None


def cached_choice(
    order: Sequence[str], matched: Mapping[str, int], queue_lens: Mapping[str, int | None], imbalance_threshold: int
) -> str | None:
    """Among the replicas within the load guard (at most ``imbalance_threshold`` more
    requests than the least busy), the one holding the longest cached run of the
    prompt (``matched``: leading blocks held); of equals, the least busy, then the
    first in ``order``. Nothing cached on any of them: the first of ``order`` within
    the guard (every ingress replica agrees on a new prompt). None when no replica
    is within the guard."""
    least = min((length or 0 for length in queue_lens.values()), default=0)
    eligible = [rid for rid in order if (queue_lens.get(rid) or 0) - least <= imbalance_threshold]
    if not eligible:
        return None
    best = max(matched.get(rid, 0) for rid in eligible)
    if best == 0:
        return eligible[0]
    rank = {rid: i for i, rid in enumerate(order)}
    return min(
        (rid for rid in eligible if matched.get(rid, 0) == best), key=lambda rid: (queue_lens.get(rid) or 0, rank[rid])
    )


class ChosenNotSent:
    """Requests this router has chosen a replica for that Serve has not yet sent.

    Serve counts a request in its queue-length cache only once it is sent; the
    routing tasks of a burst choose concurrently before any is sent, and each
    probe that finds the cache expired answers with the count from before the
    burst. Without this count every request of a burst sees the preferred replica
    idle and the load guard never trips. An entry ends when Serve sends a request
    to that replica, or after ``ttl_s`` for a choice Serve dropped (a cancelled
    request, a full replica passed over): a choice is sent within milliseconds.

    A choice Serve never sends (the edge router's: the request goes over HAProxy,
    serve_app/http/edge_router.py) ends when its replica's own count has it: once a
    probe of that replica asked ``PROBE_LAG_S`` after the choice was made. The edge
    router probes often, so its finished requests stop counting soon after they end.
    """

    # How long a request chosen at the edge takes to reach its replica (router answer,
    # HAProxy, connection): a probe asked later than this after the choice counts it.
    PROBE_LAG_S = 0.05

    def __init__(self, ttl_s: float = 2.0, clock=time.monotonic):
        self._ttl_s, self._clock = ttl_s, clock
        self._chosen: dict[str, deque[float]] = defaultdict(deque)

    def add(self, replica_id: str) -> None:
        self._chosen[replica_id].append(self._clock())

    def sent(self, replica_id: str) -> None:
        chosen = self._chosen.get(replica_id)
        if chosen:
            chosen.popleft()

    def count(self, replica_id: str, probed_at: float | None = None) -> int:
        """The choices of ``replica_id`` its count does not have yet: younger than the
        time to live, and made after ``probed_at - PROBE_LAG_S`` (when its count was
        last asked; None: not asked since)."""
        chosen = self._chosen.get(replica_id)
        if not chosen:
            return 0
        oldest_live = self._clock() - self._ttl_s
        if probed_at is not None:
            oldest_live = max(oldest_live, probed_at - self.PROBE_LAG_S)
        while chosen and chosen[0] < oldest_live:
            chosen.popleft()
        return len(chosen)

    def now(self) -> float:
        return self._clock()

    def forget_others(self, replica_ids: set[str]) -> None:
        """Drops the entries of replicas that are gone (bounded by the replica set)."""
        for replica_id in [rid for rid in self._chosen if rid not in replica_ids]:
            del self._chosen[replica_id]
