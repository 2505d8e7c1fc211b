"""The replica's prompt allowance (replicas/prompt_allowance.py): every prompt the
renderer's entry points render is charged to the request being answered, once
(an entry point calling another is not counted twice), on the renderer's thread
pool too; a request over its allowance fails before its inputs go anywhere (at the
render, or for a request counted whole at the engine's door, which also counts what
no render did); and what is not counted (no allowance, a prompt rendered only to be
tokenized) is never refused. (On vLLM's real renderer: tests/integration/
test_prompt_bound*.py; on the stack: test_1_reservation_bound_e2e.py, test_dense_pooling_e2e.py.)"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from replicas.prompt_allowance import PromptOverAllowance, allowing, enforce_on, guard_the_door, uncounted


class Renderer:
    """vLLM's Renderer as the allowance sees it: chat answers (conversations,
    inputs), completions the inputs; each input here is a list of token ids."""

    def render_cmpl(self, prompts, *_, **__):
        return [list(prompt) for prompt in prompts]

    def render_chat(self, conversations, *_, **__):
        return conversations, [[0] * sum(map(len, conversation)) for conversation in conversations]

    async def render_cmpl_async(self, prompts, *_, **__):
        await asyncio.sleep(0)
        return self.render_cmpl(prompts)

    async def render_chat_async(self, conversations, *_, **__):
        await asyncio.sleep(0)
        return self.render_chat(conversations)

    def process_for_engine(self, prompt, *_, **__):
        return {"prompt_token_ids": list(prompt)}

    async def process_for_engine_async(self, prompt, *_, **__):
        return self.process_for_engine(prompt)

    def __init__(self):
        self._executor = ThreadPoolExecutor(2)  # vLLM's pooling renders here (make_async)


def length(engine_input) -> int:
    return len(engine_input["prompt_token_ids"]) if isinstance(engine_input, dict) else len(engine_input)


def renderer() -> Renderer:
    made = Renderer()
    enforce_on(made, length)
    return made


async def test_every_entry_point_counts_against_one_allowance():
    made = renderer()
    with allowing(10) as allowance:
        made.render_cmpl([[1, 2], [3]])  # 3
        made.render_chat([["ab", "c"]])  # 3
        await made.render_cmpl_async([[1]])  # 1
        await made.render_chat_async([["abc"]])  # 3
        assert allowance.used == 10 and not allowance.exceeded
        with pytest.raises(PromptOverAllowance):
            made.render_cmpl([[1]])
    assert allowance.exceeded and allowance.used == 11


@pytest.mark.parametrize("entry", ["render_cmpl", "render_cmpl_async"])
async def test_a_list_of_prompts_is_counted_whole_so_one_resize_is_enough(entry):
    made = renderer()
    with allowing(4) as allowance:
        with pytest.raises(PromptOverAllowance):
            result = getattr(made, entry)([[1] * 3, [2] * 3, [3] * 3])
            if asyncio.iscoroutine(result):
                await result
    assert allowance.used == 9  # every prompt of the call, not the first past the limit


async def test_without_an_allowance_or_when_uncounted_nothing_is_refused():
    made = renderer()
    made.render_cmpl([[0] * 10**5])  # the tokenizer routes: no allowance
    with allowing(1) as allowance:
        with uncounted():
            await made.render_chat_async([["x" * 1000]])
        assert allowance.used == 0
    with allowing(None) as none:
        made.render_cmpl([[0] * 10])
    assert none is None


async def test_the_allowance_is_seen_by_the_tasks_a_rendering_gathers():
    made = renderer()
    with allowing(5) as allowance:
        await asyncio.gather(made.render_cmpl_async([[1, 2]]), made.render_cmpl_async([[3, 4]]))
    assert allowance.used == 4


async def test_a_render_on_the_renderers_thread_pool_counts_against_the_request_that_sent_it():
    """vLLM's pooling renders on its renderer's executor (``loop.run_in_executor``, which
    carries no context): two requests' renders there count each to its own allowance."""
    made = renderer()
    loop = asyncio.get_running_loop()

    async def request(tokens: int):
        with allowing(100) as allowance:
            await loop.run_in_executor(made._executor, made.render_cmpl, [[0] * tokens])
            await loop.run_in_executor(made._executor, made.process_for_engine, [0] * tokens)
        return allowance.used

    assert await asyncio.gather(request(3), request(7)) == [6, 14]


class Engine:
    """vLLM's ``AsyncLLM`` as the door sees it: what reached ``add_request``."""

    def __init__(self):
        self.added = []
        guard_the_door(self, length)

    async def add_request(self, request_id, prompt, params, **kwargs):
        self.added.append(prompt)


async def test_counted_whole_the_renders_past_the_limit_go_on_and_the_door_refuses_every_prompt():
    made, engine = renderer(), Engine()
    with allowing(5, whole=True) as allowance:
        inputs = [made.process_for_engine([0] * 4) for _ in range(3)]  # no refusal yet: 12 counted
        for i, engine_input in enumerate(inputs):
            with pytest.raises(PromptOverAllowance):
                await engine.add_request(f"r{i}", engine_input, None)
    assert allowance.used == 12 and engine.added == []


async def test_the_door_counts_an_engine_input_no_render_counted_and_lets_a_counted_one_pass():
    made, engine = renderer(), Engine()
    with allowing(10) as allowance:
        counted = made.process_for_engine([0] * 6)
        await engine.add_request("r1", counted, None)
        assert allowance.used == 6 and allowance.at_the_door == 0
        with pytest.raises(PromptOverAllowance):
            await engine.add_request("r2", {"prompt_token_ids": [0] * 5}, None)  # rendered by no wrapped step
    assert allowance.used == 11 and allowance.at_the_door == 5 and engine.added == [counted]
    await engine.add_request("r3", {"prompt_token_ids": [0] * 10**4}, None)  # no allowance: not counted
    assert len(engine.added) == 2
