"""What this replica's engine still holds of the prompts it served, told to the router
in the router's own terms: from vLLM's KV-cache events, the router's text-block hashes
(contract/prompt_blocks.py) of each prompt's leading part still cached.

vLLM's events (``kv_events_config``: ``BlockStored`` with the block's hash, its parent's
and its tokens; ``BlockRemoved``; ``AllBlocksCleared``) name blocks by hashes of token
ids, and a router never tokenizes (it would cost every request a tokenizer and a chat
template at the edge). So the replica, which sees both sides, translates: each prompt it
sends to the engine carries a key of its own as vLLM's ``session_id`` (which vLLM puts on
every event the request causes, and uses for nothing else), with ``kv_cache_report_mode:
full`` so that blocks found already cached are reported too. The events then give each
prompt's chain of blocks; a removed block ends what the engine can reuse of every prompt
whose chain holds it. The prompt's router hashes held are those whose text ends within
the held tokens, mapped through the prompt's tokens per character (its usage once it
ends; while it runs, the replica's average so far).

The router reads the published hashes from Serve's routing stats (``record_routing_stats``,
asked by Serve's controller every ``request_routing_stats_period_s`` and handed to every
router of the model). Bounded: ``max_prompts`` prompts tracked (least recently used
dropped), ``max_published`` hashes published (the newest prompts first).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from contract.prompt_blocks import MAX_HASHED_CHARS, block_hashes, prompt_text

logger = logging.getLogger("ray.serve")

# The operations whose prompt the router hashes (prompt_text reads messages or prompt).
TRACKED_OPERATIONS = frozenset({"chat", "completions"})

# A token of text is about four characters; the estimate before any prompt has ended.
FIRST_TOKENS_PER_CHAR = 0.25

USAGE_PROMPT_TOKENS = re.compile(r'"prompt_tokens":\s*(\d+)')


@dataclass
class _Prompt:
    text_hashes: list[bytes]
    text_chars: int  # the whole prompt's characters (the hashes cover at most MAX_HASHED_CHARS)
    prompt_tokens: int | None = None  # known once it ended
    chain: list[Any] = field(default_factory=list)  # vLLM's block hashes, from the first block
    block_size: int = 0
    held_blocks: int = 0  # the leading blocks of the chain still cached


class HeldPrompts:
    """Prompts this replica served and how much of each its engine still holds."""

    def __init__(self, block_chars: int, max_prompts: int = 4096, max_published: int = 50_000):
        self.block_chars, self.max_prompts, self.max_published = block_chars, max_prompts, max_published
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()
        self._owners: dict[Any, set[str]] = {}  # vLLM block hash -> the tracked prompts whose chain holds it
        self._tokens, self._chars = 0, 0  # of the prompts that ended: tokens per character

    def __len__(self) -> int:
        return len(self._prompts)

    def start(self, body: dict[str, Any]) -> str | None:
        """A key for this request's prompt (None: it has none the router reads)."""
        text = prompt_text(body, limit=1 << 62)
        hashes = block_hashes(text[:MAX_HASHED_CHARS], self.block_chars)
        if not hashes:
            return None
        key = "llm-route-" + uuid.uuid4().hex
        self._prompts[key] = _Prompt(hashes, len(text))
        while len(self._prompts) > self.max_prompts:
            self._drop(next(iter(self._prompts)))
        return key

    def ended(self, key: str | None, prompt_tokens: int | None) -> None:
        prompt = self._prompts.get(key) if key else None
        if prompt is None or not prompt_tokens or prompt_tokens <= 0:
            return
        prompt.prompt_tokens = prompt_tokens
        self._tokens += prompt_tokens
        self._chars += prompt.text_chars

    def on_events(self, events: Iterable[Any]) -> None:
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for block in event.block_hashes:
                    for key in self._owners.pop(block, ()):
                        prompt = self._prompts.get(key)
                        if prompt is not None and block in prompt.chain:
                            prompt.held_blocks = min(prompt.held_blocks, prompt.chain.index(block))
                            if prompt.held_blocks == 0:
                                self._drop(key)
            elif kind == "AllBlocksCleared":
                self._prompts.clear()
                self._owners.clear()

    def _stored(self, event: Any) -> None:
        key = event.session_id
        prompt = self._prompts.get(key) if key else None
        if prompt is None:
            return
        if event.parent_block_hash is None:  # the request's blocks from the first (reused ones too: full mode)
            self._release(key, prompt.chain)
            prompt.chain, prompt.held_blocks = [], 0
        elif not prompt.chain or prompt.chain[-1] != event.parent_block_hash:
            return  # a step whose start was missed: what we know ends before it
        whole = prompt.held_blocks == len(prompt.chain)
        prompt.chain.extend(event.block_hashes)
        prompt.block_size = event.block_size
        if whole:
            prompt.held_blocks = len(prompt.chain)
        for block in event.block_hashes:
            self._owners.setdefault(block, set()).add(key)
        self._prompts.move_to_end(key)

    def _release(self, key: str, chain: list[Any]) -> None:
        for block in chain:
            owners = self._owners.get(block)
            if owners is not None:
                owners.discard(key)
                if not owners:
                    del self._owners[block]

    def _drop(self, key: str) -> None:
        prompt = self._prompts.pop(key, None)
        if prompt is not None:
            self._release(key, prompt.chain)

    def published(self) -> frozenset[bytes]:
        """The router's hashes of what the engine holds: of each prompt, the blocks whose
        text ends within its held tokens; the newest prompts first, at most ``max_published``."""
        per_char = self._tokens / self._chars if self._chars else FIRST_TOKENS_PER_CHAR
        held: set[bytes] = set()
        for prompt in reversed(self._prompts.values()):
            if not prompt.held_blocks:
                continue
            tokens = prompt.prompt_tokens or max(1, round(prompt.text_chars * per_char))
            held_tokens = min(prompt.held_blocks * prompt.block_size, tokens)
            # Text block k (0-based) ends at character (k+1)*block_chars, at about that
            # share of the prompt's tokens: held when that is within the held tokens.
            count = min(len(prompt.text_hashes), held_tokens * prompt.text_chars // (tokens * self.block_chars))
            held.update(prompt.text_hashes[:count])
            if len(held) >= self.max_published:
                break
        return frozenset(held)


def prompt_tokens_in(sse_text: str) -> int | None:
    """The prompt tokens the last usage of a stream's text names (the gateway asks for
    usage on every stream), or None."""
    found = USAGE_PROMPT_TOKENS.findall(sse_text)
    return int(found[-1]) if found else None


class EventSocket:
    """Where the engine publishes its events: an IPC socket in a folder of this replica's own."""

    def __init__(self):
        self._folder = tempfile.mkdtemp(prefix="llm-kv-events-")
        self.endpoint = f"ipc://{self._folder}/events"

    def engine_config(self) -> dict[str, Any]:
        """vLLM's ``kv_events_config`` publishing here."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint}

    def remove(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


async def follow(endpoint: str, held: HeldPrompts) -> None:
    """Feeds ``held`` with the engine's events until cancelled. A batch that does not
    decode is skipped (a prompt then shows less held than it is, never more)."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                batch = decoder.decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("a KV-cache event batch did not decode: %s", exc)
                continue
            held.on_events(batch.events)
    except asyncio.CancelledError:
        raise
    finally:
        socket.close(linger=0)
