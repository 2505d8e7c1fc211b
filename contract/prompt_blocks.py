"""How a prompt is cut into chained blocks: what a router and a replica agree on when the
replica tells the router what its engine holds (serve_app/routing/block_index.py keeps
the router's index; replicas/kv_events.py translates the engine's KV-cache events).

A prompt (the messages' roles and text in order, as the engine reads them first) is cut
into blocks of ``block_chars`` characters; block *i*'s hash covers blocks 0..*i*, so a
match of block *i* means the whole prompt up to it is the same (as vLLM's own block
hashes chain). A request's ``cache_salt`` (set by the gateway from its tenant:
serve_app/identity/cache_isolation.py) comes before its text, as vLLM puts it in its
first block's hash: two tenants' same prompt are different texts to every router and
index, as they are different blocks to the engine."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

# A prompt longer than this is hashed over its first part only: a routing decision
# costs O(prompt) and a 1 MB body must not make it slow. 256 blocks of 256 characters.
MAX_HASHED_CHARS = 65_536


def prompt_text(body: Any, limit: int = MAX_HASHED_CHARS) -> str:
    """The first ``limit`` characters of what the engine reads first: the messages'
    roles and text in order, or the prompt (the first of a batch), after the request's
    cache salt. '' when there is none (then nothing is gained by affinity)."""
    if not isinstance(body, Mapping):
        return ""
    salt = body.get("cache_salt")
    head = f"\x1d{salt}\x1d" if isinstance(salt, str) and salt else ""
    text = _unsalted_text(body, limit)
    return head + text if text else ""


def _unsalted_text(body: Mapping[str, Any], limit: int) -> str:
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
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(block, key=previous, digest_size=12).digest()
        hashes.append(previous)
    return hashes


# The key of a replica's routing stats (Serve's ``record_routing_stats``) under which it
# publishes the hashes of what its engine holds (replicas/kv_events.py), as a frozenset.
CACHED_BLOCKS = "cached_blocks"
