"""Several models at once, as configs/multi.yaml ships them, on the package's
cluster (conftest.py: the local twin, more than one node): two chat models of
different sizes (the small one with LoRA adapters through Serve model
multiplexing) and an embedding model, each its own deployment and engine,
routed by `model`. The only changes to the shipped config (twin.twin_config): an
adapter folder, so '<model>:<folder>' adapters are tested too, and a "thinking"
variant of the demo model for vLLM's reasoning parser."""

from __future__ import annotations

import openai
import openai_spec
import pytest
from stack import create_key, demo_token_id, replica_engine_processes

from cluster_twin.twin import EMBED, PIRATE, SMALL, THINKING, TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "Tell me about the license."}]


def greedy(client, model, **extra):
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=24, temperature=0, **extra)
    return reply.model, reply.choices[0].message.content


def test_every_model_is_listed_with_what_it_serves(client):
    cards = {card.id: card.model_extra for card in client.models.list().data}
    assert list(cards) == [TINY, "chat-default", SMALL, PIRATE, EMBED, THINKING]
    assert (
        cards[SMALL]["capabilities"] == cards[TINY]["capabilities"] == ["chat", "completions", "messages", "responses"]
    )
    assert cards[EMBED]["capabilities"] == ["embeddings", "rerank", "score"]
    assert cards[PIRATE]["parent"] == SMALL and cards["chat-default"]["alias_of"] == TINY


def test_each_model_runs_its_own_engine_and_answers_under_its_name(client):
    for model in (TINY, SMALL, EMBED):
        assert replica_engine_processes(model), f"no engine for {model}"
    tiny, small = greedy(client, TINY), greedy(client, SMALL)
    assert tiny[0] == TINY and small[0] == SMALL
    assert tiny[1] != small[1]  # different weights, same prompt, greedy
    embedding = client.embeddings.create(model=EMBED, input="hello").data[0].embedding
    assert len(embedding) == 384


def test_a_configured_lora_adapter_changes_the_output_of_its_base(client):
    name, adapted = greedy(client, PIRATE)
    assert name == PIRATE
    assert adapted != greedy(client, SMALL)[1]
    assert greedy(client, PIRATE) == (PIRATE, adapted)  # deterministic, served from the loaded adapter


def test_an_adapter_folder_is_loaded_on_demand_as_model_colon_folder(client):
    name, from_folder = greedy(client, f"{SMALL}:pirate-copy")
    assert name == f"{SMALL}:pirate-copy"
    assert from_folder == greedy(client, PIRATE)[1]  # same weights as the named adapter


def test_adapters_stream_too(client):
    chunks = client.chat.completions.create(model=PIRATE, messages=PROMPT, max_tokens=24, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == greedy(client, PIRATE)[1]


@pytest.mark.parametrize("model", [f"{SMALL}:missing", f"{SMALL}:..", f"{TINY}:pirate-copy", "pirate-copy"])
def test_unknown_adapters_are_404_model_not_found(client, model):
    with pytest.raises(openai.NotFoundError) as caught:
        greedy(client, model)
    assert caught.value.body["code"] == "model_not_found"
    assert greedy(client, SMALL)[0] == SMALL  # the base model is unharmed


def test_a_key_limited_to_the_base_model_may_use_its_adapters_only(base_url, redis_server):
    _, secret = create_key(redis_server.url, "small-only", models=[SMALL])
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    assert greedy(client, PIRATE)[0] == PIRATE
    with pytest.raises(openai.NotFoundError) as caught:  # answered as a model that does not exist
        greedy(client, TINY)
    assert caught.value.body["code"] == "model_not_found"
    assert [card.id for card in client.models.list().data] == [SMALL, PIRATE]


# -- reasoning: a "thinking" variant of the demo model (vLLM's DeepSeek-R1 parser) --


def think_then_answer() -> dict:
    """Make the random weights think: a grammar for `<think>word</think>word`,
    and a bias so the tags come out as the vocabulary's tag tokens (which the
    parser's streaming path looks for) rather than spelled letter by letter."""
    bias = {str(demo_token_id("<think>")): 100, str(demo_token_id("</think>")): 100}
    return {"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[a-z]{3,8}"}, "logit_bias": bias}


def test_reasoning_is_returned_as_reasoning_content(http):
    response = http.post(
        "/v1/chat/completions",
        json={"model": THINKING, "messages": PROMPT, "max_tokens": 40, "temperature": 0, **think_then_answer()},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    openai_spec.validate(body, "CreateChatCompletionResponse")
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"]
    assert message["reasoning"].isalpha() and message["content"].isalpha(), message


def test_reasoning_streams_as_reasoning_content_deltas(client):
    stream = client.chat.completions.create(
        model=THINKING,
        messages=PROMPT,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body=think_then_answer(),
    )
    thinking, answer = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            assert delta.get("reasoning_content") == delta.get("reasoning")
            thinking += delta.get("reasoning_content") or ""
            answer += choice.delta.content or ""
    assert thinking.isalpha() and answer.isalpha(), (thinking, answer)
