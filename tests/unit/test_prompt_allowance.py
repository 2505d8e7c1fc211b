"""The replica's prompt allowance (replicas/prompt_allowance.py): every prompt the
renderer's four entry points render is charged to the request being answered, once
(an entry point calling another is not counted twice), a request over its allowance
fails before its inputs go anywhere, and what is not counted (no allowance, a prompt
rendered only to be tokenized) is never refused. (On vLLM's real renderer: the
quota stack's tests/e2e/quota_stack/test_1_reservation_bound_e2e.py.)"""

import asyncio

import pytest

from replicas.prompt_allowance import PromptOverAllowance, allowing, enforce_on, uncounted


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


def renderer() -> Renderer:
    made = Renderer()
    enforce_on(made, len)
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
