"""What each replica of a model likely holds in its prefix cache, as the router saw it:
a bounded index of chained block hashes of the prompts it sent there.

A prompt (the messages' roles and text in order, as the engine reads them first) is cut
into blocks of ``block_chars`` characters; block *i*'s hash covers blocks 0..*i*, so a
match of block *i* means the whole prompt up to it is the same (as vLLM's own block
hashes chain). After a request is sent to a replica, its blocks are recorded there: vLLM
then holds them until its cache evicts them. The longest run of leading blocks a replica
holds is how much of the prompt it would not recompute.

Bounded: at most ``max_blocks`` distinct block hashes in all (about 100 bytes each), the
least recently used dropped first, as an engine's cache drops them; a replica that is
gone is forgotten. Each ingress replica keeps its own index (no shared state, nothing
on the request path but dictionary lookups); what it has not seen it routes as the
prefix router does, so ingress replicas still agree on new prompts.

The engine's own KV-cache events (vLLM's ``kv_events_config``) would say exactly what
each engine holds; this index is the approximation that needs nothing from the engine
(llm-d's "approximate prefix" scorer, SGLang's radix tree in the router)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# A prompt longer than this is hashed over its first part only: a routing decision
# costs O(prompt) and a 1 MB body must not make it slow. 256 blocks of 256 characters.
MAX_HASHED_CHARS = 65_536


def prompt_text(body: Any, limit: int = MAX_HASHED_CHARS) -> str:
    """The first ``limit`` characters of what the engine reads first: the messages'
    roles and text in order, or the prompt (the first of a batch). '' when there is
    none (then nothing is gained by affinity)."""
    if not isinstance(body, Mapping):
        return ""
    parts: list[str] = []
    size = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            for text in (str(message.get("role", "")), "\x1f", *_texts(message.get("content")), "\x1e"):
                parts.append(text)
                size += len(text)
                if size >= limit:
                    return "".join(parts)[:limit]
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, int)):
        # One prompt of token ids, or the first of a batch of prompts.
        first = prompt if isinstance(prompt[0], int) else prompt[0]
        return (first if isinstance(first, str) else ",".join(map(str, first)))[:limit]
    return ""


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]
    return []


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of ``text``'s whole blocks (a partial last block is not cached
    as a block by vLLM either, and would change with every token appended)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = text[start:start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(block, key=previous, digest_size=12).digest()
        hashes.append(previous)
    return hashes


class BlockIndex:
    """Block hash -> the replicas it was sent to, least recently used first."""

    def __init__(self, max_blocks: int = 100_000):
        self.max_blocks = max_blocks
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def matched(self, hashes: Sequence[bytes], replica_ids: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of the prompt each replica holds."""
        matched = {rid: 0 for rid in replica_ids}
        alive = set(matched)
        for depth, block in enumerate(hashes, start=1):
            holders = self._holders.get(block)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for rid in alive:
                matched[rid] = depth
        return matched

    def record(self, hashes: Sequence[bytes], replica_id: str) -> None:
        """``replica_id`` now holds these blocks (the request was sent there)."""
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = {replica_id}
            else:
                holders.add(replica_id)
                self._holders.move_to_end(block)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def forget_others(self, replica_ids: set[str]) -> None:
        """Replicas that are gone hold nothing (their blocks go, or lose them)."""
        for block in list(self._holders):
            holders = self._holders[block]
            holders &= replica_ids
            if not holders:
                del self._holders[block]
