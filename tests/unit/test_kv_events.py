"""A replica's translation of its engine's KV-cache events into the router's block
hashes (replicas/kv_events.py), with vLLM's own event classes: what is published for a
prompt the engine holds, what a removed block takes away, and that it stays bounded."""

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from contract.prompt_blocks import block_hashes, prompt_text
from replicas.kv_events import HeldPrompts, prompt_tokens_in

BLOCK = 128  # tokens per engine block
CHARS = 256  # characters per router block


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def stored(key, blocks, parent=None):
    return BlockStored(
        block_hashes=list(blocks),
        parent_block_hash=parent,
        token_ids=[1] * BLOCK * len(blocks),
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        session_id=key,
    )


def removed(*blocks):
    return BlockRemoved(block_hashes=list(blocks), medium="GPU")


SYSTEM = "Answer politely, cite the policy, never promise refunds. " * 40  # 2,240 characters


def test_a_prompt_the_engine_holds_is_published_in_the_routers_hashes():
    held = HeldPrompts(CHARS)
    body = chat(SYSTEM, "Where is my parcel? " * 20)
    router_hashes = block_hashes(prompt_text(body), CHARS)  # what the router computes for this body
    key = held.start(body)
    assert key and held.published() == frozenset()  # nothing stored yet
    # 6 blocks of 128 tokens stored (768 of its ~660 prompt tokens: the rest is output).
    held.on_events([stored(key, [11, 12, 13])])
    held.on_events([stored(key, [14, 15, 16], parent=13)])
    held.ended(key, 660)
    assert held.published() == frozenset(router_hashes)  # the whole prompt is held
    # Block 3 evicted: the engine can reuse only the first 3 blocks (384 tokens, ~58% of the prompt).
    held.on_events([removed(14)])
    text_chars = len(prompt_text(body))
    count = 384 * text_chars // (660 * CHARS)
    assert 0 < count < len(router_hashes)
    assert held.published() == frozenset(router_hashes[:count])
    # The first block gone: nothing of it is reusable, and the prompt is forgotten.
    held.on_events([removed(11)])
    assert held.published() == frozenset() and len(held) == 0


def test_a_prompt_that_reused_cached_blocks_is_held_with_them_and_loses_them_with_them():
    held = HeldPrompts(CHARS)
    first, second = chat(SYSTEM, "first question " * 30), chat(SYSTEM, "second question " * 30)
    k1, k2 = held.start(first), held.start(second)
    held.on_events([stored(k1, [1, 2, 3, 4, 5])])
    # Full report mode: the second's reused blocks come first, then its own.
    held.on_events([stored(k2, [1, 2, 3]), stored(k2, [6, 7], parent=3)])
    held.ended(k1, 640)  # each prompt exactly its 5 blocks
    held.ended(k2, 640)
    both = set(block_hashes(prompt_text(first), CHARS)) | set(block_hashes(prompt_text(second), CHARS))
    assert held.published() == frozenset(both)
    held.on_events([removed(2)])  # a shared block: both keep only their first block
    only_first_block = held.published()
    assert only_first_block and only_first_block <= set(block_hashes(prompt_text(first), CHARS)[:2])
    held.on_events([AllBlocksCleared()])
    assert held.published() == frozenset() and len(held) == 0


def test_events_it_cannot_place_change_nothing():
    held = HeldPrompts(CHARS)
    key = held.start(chat(SYSTEM, "q"))
    held.on_events([stored("someone-else", [1, 2]), stored(None, [3]), removed(99)])
    held.on_events([stored(key, [5, 6], parent=42)])  # its first step was missed: unknown start
    held.ended(key, 600)
    assert held.published() == frozenset()
    assert held.start({"messages": "not a list"}) is None and held.start(chat("short", "")) is None


def test_a_running_prompt_is_estimated_by_the_tokens_per_character_of_those_that_ended():
    held = HeldPrompts(CHARS)
    ended = held.start(chat(SYSTEM, "a" * 100))
    held.on_events([stored(ended, [1, 2, 3, 4, 5])])
    held.ended(ended, 640)  # ~0.27 tokens per character
    running = chat("Another application's prompt. " * 80, "b")  # 2,400+ characters, ~650 tokens
    key = held.start(running)
    held.on_events([stored(key, [21, 22])])  # 256 tokens prefilled so far, not ended
    mine = block_hashes(prompt_text(running), CHARS)
    published = held.published() & set(mine)
    assert 0 < len(published) < len(mine) and published == set(mine[: len(published)])


def test_it_stays_bounded():
    held = HeldPrompts(CHARS, max_prompts=50, max_published=300)
    for n in range(500):
        key = held.start(chat(f"application {n}. " + SYSTEM, "q"))
        held.on_events([stored(key, [n * 10 + i for i in range(6)])])
        held.ended(key, 700)
    assert len(held) == 50
    assert len(held._owners) == 50 * 6
    assert 300 <= len(held.published()) < 300 + 20  # stops after the prompt that passes the bound


def test_the_prompt_tokens_of_a_streams_last_event():
    last = 'data: {"choices":[],"usage":{"prompt_tokens":812,"completion_tokens":5}}\n\ndata: [DONE]\n\n'
    assert prompt_tokens_in(last) == 812
    assert prompt_tokens_in('data: {"choices":[{"delta":{"content":"x"}}]}\n\n') is None
