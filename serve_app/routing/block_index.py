"""What each replica of a model likely holds in its prefix cache, as the router knows it:
a bounded index of chained block hashes (contract/prompt_blocks.py) of the prompts it
sent there, and what each replica's engine says it still holds.

After a request is sent to a replica, its blocks are recorded there: vLLM then holds
them until its cache evicts them. The longest run of leading blocks a replica holds is
how much of the prompt it would not recompute.

Bounded: at most ``max_blocks`` distinct block hashes in all (about 100 bytes each), the
least recently used dropped first, as an engine's cache drops them; a replica that is
gone is forgotten. Each router keeps its own index (no shared state, nothing on the
request path but dictionary lookups); what it has not seen it routes as the prefix
router does, so routers still agree on new prompts.

Where a replica publishes what its engine holds (replicas/kv_events.py: vLLM's KV-cache
events, in these hashes, through Serve's routing stats), that is the truth about it, and
this router's own records of it count only while they are younger than ``trust_own_s``:
long enough to cover a request's wait, prefill and the next publication, after which the
engine has said whether it still holds them (llm-d's "precise prefix" scorer, fed by the
same events). A replica that publishes nothing (another engine, events off) is taken to
hold what was sent to it until the index drops it (the "approximate prefix" scorer)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence


class BlockIndex:
    """Block hash -> the replicas it was sent to (and when), least recently used first."""

    def __init__(self, max_blocks: int = 100_000, clock=time.monotonic):
        self.max_blocks = max_blocks
        self._clock = clock
        self._holders: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def matched(
        self,
        hashes: Sequence[bytes],
        replica_ids: Iterable[str],
        published: Mapping[str, Collection[bytes]] | None = None,
        trust_own_s: float = 0.0,
    ) -> dict[str, int]:
        """How many leading blocks of the prompt each replica holds: a block it published
        (``published``: what the engines of the replicas that publish say they hold), or
        one this router sent it, within ``trust_own_s`` where the replica publishes."""
        published = published or {}
        since = self._clock() - trust_own_s
        matched = {}
        for rid in replica_ids:
            engine_says = published.get(rid)
            depth = 0
            for block in hashes:
                if engine_says is not None and block in engine_says:
                    depth += 1
                    continue
                sent = (self._holders.get(block) or {}).get(rid)
                if sent is None or (engine_says is not None and sent < since):
                    break
                depth += 1
            matched[rid] = depth
        return matched

    def record(self, hashes: Sequence[bytes], replica_id: str) -> None:
        """``replica_id`` now holds these blocks (the request was sent there)."""
        now = self._clock()
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = {replica_id: now}
            else:
                holders[replica_id] = now
                self._holders.move_to_end(block)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def forget_others(self, replica_ids: set[str]) -> None:
        """Replicas that are gone hold nothing (their blocks go, or lose them)."""
        for block in list(self._holders):
            holders = self._holders[block]
            for rid in [rid for rid in holders if rid not in replica_ids]:
                del holders[rid]
            if not holders:
                del self._holders[block]
