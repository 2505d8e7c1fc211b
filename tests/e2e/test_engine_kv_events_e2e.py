"""What a replica tells the routers its engine holds, from the real vLLM engine's
KV-cache events (replicas/kv_events.py): the demo model's engine started as a replica
starts it for a ``cache_affinity`` model (publishing its events on the replica's own
socket), prompts sent as the replica sends them (its key as vLLM's ``session_id``,
``kv_cache_report_mode: full``), and the published router hashes read back — then a
flood of other prompts through a cache of 20 blocks evicts the first, and its hashes go.
And two tenants' cache salts (serve_app/identity/cache_isolation.py) keep one prompt's
blocks apart in the engine: the second tenant's copy finds nothing of the first's
cached and is stored as blocks of its own; each tenant's repeat is served from its own.
"""

from __future__ import annotations

import asyncio

import pytest

from contract.model_config import ModelConfig
from contract.prompt_blocks import block_hashes, prompt_text

pytestmark = pytest.mark.e2e

KV_BLOCKS = 20  # of 128 tokens: 2,560 tokens of cache, about four of these prompts


def chat(system: str, user: str) -> dict:
    return {
        "model": "demo",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def system_prompt(n: int) -> str:
    return f"Application {n}. " + "license grant patent copyright notice source object form work " * 45


def leading(published: frozenset[bytes], hashes: list[bytes]) -> int:
    """How many of the prompt's leading blocks are published (what a router matches)."""
    count = 0
    while count < len(hashes) and hashes[count] in published:
        count += 1
    return count


async def until(condition, timeout_s: float = 10.0) -> None:
    """The events reach the replica's socket shortly after the engine step that caused them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline
        await asyncio.sleep(0.05)


async def test_the_engine_s_events_say_what_it_holds_in_the_routers_terms(monkeypatch):
    import replicas.vllm_engine as vllm_engine
    from replicas.kv_events import HeldPrompts, follow
    from replicas.vllm_replica import VLLMReplica

    monkeypatch.setattr(vllm_engine, "placement_facts", lambda vllm_config: {})  # no Ray worker here
    config = ModelConfig(
        name="demo",
        source="demo",
        routing={"policy": "cache_affinity"},
        engine_kwargs={
            "num_gpu_blocks_override": KV_BLOCKS,
            "max_model_len": 2048,
            # A fixed KV size, so the CPU worker does not ask for its
            # default 0.92 of the node's memory free (in a full run the
            # earlier stacks' processes hold some: it refused to start).
            "kv_cache_memory_bytes": 64 << 20,
        },
    )
    binding = await vllm_engine.start_vllm(config)
    assert binding.kv_events is not None
    held = HeldPrompts(config.routing.block_chars)
    following = asyncio.create_task(follow(binding.kv_events.endpoint, held))
    replica = type("Replica", (), {"_held": held})()  # what VLLMReplica._tracked reads
    request_type, _, handler = binding.endpoints["chat"]

    asked: list[str] = []  # each prompt's key, in order

    async def ask(body: dict):
        tracked, key = VLLMReplica.func_or_class._tracked(replica, "chat", body)
        assert key is not None and tracked["session_id"] == key and "session_id" not in body
        asked.append(key)
        answer = await handler(request_type.validate_python(tracked))
        held.ended(key, answer.usage.prompt_tokens)
        return answer

    try:
        await asyncio.sleep(0.5)  # the subscription joins before the first event
        first = chat(system_prompt(0), "Where is my parcel? " * 10)
        mine = block_hashes(prompt_text(first), config.routing.block_chars)
        await ask(first)
        # Its whole blocks are cached (4 of 128 tokens of its ~630: the partial last one is not).
        await until(lambda: leading(held.published(), mine) >= 0.7 * len(mine))
        assert len(held.published() & set(mine)) == leading(held.published(), mine)  # the start, not parts
        # The same prompt again: its blocks are found cached, and it is still held.
        before = leading(held.published(), mine)
        await ask(first)
        await asyncio.sleep(0.5)
        assert leading(held.published(), mine) == before
        # Other applications' prompts (4 blocks each) fill the cache: the first one's blocks are evicted.
        for n in range(1, 8):
            await ask(chat(system_prompt(n), "Cancel my order. " * 10))
        await until(lambda: not held.published() & set(mine))
        assert held.published()  # what the engine holds now is the others'

        # One prompt, two tenants' salts: the engine shares nothing between them.
        def cached(answer) -> int:
            return answer.usage.prompt_tokens_details.cached_tokens

        shared = chat(system_prompt(100), "What does the licence grant? " * 10)
        tenant_a, tenant_b = {**shared, "cache_salt": "A" * 43}, {**shared, "cache_salt": "B" * 43}
        assert cached(await ask(tenant_a)) == 0
        assert cached(await ask(tenant_a)) > 0  # its own repeat: from its cache
        assert cached(await ask(tenant_b)) == 0  # the same text under another salt: nothing
        assert cached(await ask(tenant_b)) > 0
        await asyncio.sleep(0.5)
        a_blocks = {block for key in asked[-4:-2] for block in held._prompts[key].chain}
        b_blocks = {block for key in asked[-2:] for block in held._prompts[key].chain}
        assert a_blocks and b_blocks and not a_blocks & b_blocks  # other blocks in the engine
        a_hashes = block_hashes(prompt_text(tenant_a), config.routing.block_chars)
        b_hashes = block_hashes(prompt_text(tenant_b), config.routing.block_chars)
        assert leading(held.published(), a_hashes) > 0 and leading(held.published(), b_hashes) > 0
        assert not set(a_hashes) & set(b_hashes)  # and to the routers, two prompts
    finally:
        following.cancel()
        binding.engine.shutdown()
        binding.kv_events.remove()
