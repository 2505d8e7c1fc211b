"""The reservation bounds every prompt, as a property over adversarial input
(docs/quotas.md, "The reservation bounds every prompt"): for any text — every script,
emoji sequences, combining marks, digit, punctuation and whitespace runs, control
characters — in any request shape (chat with system, assistant and user turns, text
or content parts, tool definitions, n; completions of a text, of texts, of token ids),
the prompt tokens the engine is given never exceed the prompt tokens reserved for it,
after at most one resize. Run on vLLM's own renderer (chat template, tokenizer, as the
replica runs it: replicas/prompt_allowance.py wraps it the same way) for the demo
model's byte-level BPE and for a SentencePiece tokenizer with byte fallback
(tests/tokenizer_families.py); the gateway's side is its own reservation
(serve_app/wire/reservation.py) of the body a client would send, in raw UTF-8 (the
fewest bytes, so the lowest estimate)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_families import build_sentencepiece_model

from contract.model_config import ModelConfig
from replicas.prompt_allowance import PromptOverAllowance, allowing, enforce_on
from serve_app.wire.reservation import reserve

# Text a hostile tenant would send: any code point but lone surrogates (JSON cannot
# carry them: the gateway answers 400), weighted towards what tokenizes densely.
DENSE = st.sampled_from(
    [
        "😀",
        "👩‍💻",
        "🏳️‍🌈",
        "漢",
        "字",
        "த",
        "மி",
        "ழ்",
        "é",
        "e\u0301",
        "\u0300\u0301\u0302",
        "!?",
        "0",
        "9",
        " ",
        "\n",
        "\t",
        "<|im_start|>",
        "[INST]",
        "<s>",
        "\x00",
        "\u200b",
    ]
)
TEXT = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40), DENSE), max_size=30).map(
    "".join
)
ROLES = st.sampled_from(["system", "user", "assistant"])
CONTENT = st.one_of(TEXT, st.lists(TEXT.map(lambda text: {"type": "text", "text": text}), min_size=1, max_size=3))
TOOLS = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                    "description": TEXT,
                    "parameters": st.just({"type": "object", "properties": {"q": {"type": "string"}}}),
                }
            ),
        }
    ),
    max_size=2,
)


@st.composite
def chat_bodies(draw) -> dict[str, Any]:
    turns = draw(st.lists(st.tuples(ROLES, CONTENT), min_size=1, max_size=4))
    body: dict[str, Any] = {"model": "m", "messages": [{"role": role, "content": content} for role, content in turns]}
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 64))
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 4))
    tools = draw(TOOLS)
    if tools:
        body["tools"] = tools
    return body


@st.composite
def completion_bodies(draw) -> dict[str, Any]:
    ids = st.lists(st.integers(0, 255), min_size=1, max_size=40)
    prompt = draw(
        st.one_of(
            TEXT.filter(bool),
            st.lists(TEXT.filter(bool), min_size=1, max_size=3),
            ids,
            st.lists(ids, min_size=1, max_size=3),
        )
    )
    return {"model": "m", "prompt": prompt, "max_tokens": draw(st.integers(0, 16))}


class Renderer:
    """vLLM's renderer for one model, wrapped as the replica wraps it."""

    def __init__(self, source: str):
        from vllm.renderers.inputs.preprocess import extract_prompt_len
        from vllm.renderers.registry import renderer_from_config

        from replicas.vllm_engine import engine_config

        _, _, self.vllm_config = engine_config(ModelConfig(name="m", source=source))
        self.model_config = self.vllm_config.model_config
        self.renderer = renderer_from_config(self.vllm_config)
        self.length = lambda engine_input: extract_prompt_len(self.model_config, engine_input)
        enforce_on(self.renderer, self.length)

    def render(self, operation: str, body: dict[str, Any]) -> list:
        """What the engine would be given for ``body``: vLLM's engine inputs."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.renderers.inputs.preprocess import parse_model_prompt, prompt_to_seq

        if operation == "chat":
            request = ChatCompletionRequest.model_validate(body)
            tools = [tool.model_dump() for tool in request.tools] if request.tools else None
            chat_params = request.build_chat_params(None, "auto").with_defaults({"tools": tools})
            _, inputs = self.renderer.render_chat(
                [request.messages], chat_params, request.build_tok_params(self.model_config)
            )
            return inputs
        request = CompletionRequest.model_validate(body)
        prompts = [parse_model_prompt(self.model_config, prompt) for prompt in prompt_to_seq(request.prompt)]
        return self.renderer.render_cmpl(prompts, request.build_tok_params(self.model_config))


@pytest.fixture(scope="module", params=["byte-level BPE", "SentencePiece byte fallback"])
def renderer(request, tmp_path_factory) -> Renderer:
    if request.param == "byte-level BPE":
        return Renderer("demo")
    return Renderer(str(build_sentencepiece_model(tmp_path_factory.mktemp("tokenizers") / "sentencepiece")))


def prompt_tokens_run(renderer: Renderer, operation: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens the engine is given, prompt tokens reserved for it) for ``body``
    sent as a client would: reserved by the gateway, refused by the renderer when
    its prompt is larger, reserved again at the count the replica reported."""
    raw_size = len(json.dumps(body, ensure_ascii=False).encode())
    reservation = reserve(
        operation, body, raw_size, default_max_tokens=64, context_length=renderer.model_config.max_model_len
    )
    from vllm.exceptions import VLLMValidationError

    for _ in range(2):
        with allowing(reservation.prompt_allowance) as allowance:
            try:
                inputs = renderer.render(operation, body)
            except PromptOverAllowance:
                reservation = reservation.resized(allowance.used)
                continue
            except VLLMValidationError as exc:  # past the model's context: a 400, nothing runs
                assert "maximum context length" in str(exc)
                return 0, reservation.prompt
        given = sum(renderer.length(engine_input) for engine_input in inputs)
        assert given == allowance.used  # what was counted is what the engine gets
        return given, reservation.prompt
    raise AssertionError(f"not admitted after one resize: {allowance.used} > {reservation.prompt}")


PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(body=chat_bodies())
def test_a_chat_never_puts_more_prompt_tokens_in_the_engine_than_were_reserved(renderer, body):
    given_tokens, reserved = prompt_tokens_run(renderer, "chat", body)
    assert given_tokens <= reserved


@PROPERTY
@given(body=completion_bodies())
def test_a_completion_never_puts_more_prompt_tokens_in_the_engine_than_were_reserved(renderer, body):
    given_tokens, reserved = prompt_tokens_run(renderer, "completions", body)
    assert given_tokens <= reserved


@pytest.mark.parametrize("script", ["😀", "漢字", "தமிழ்", "!?", "0123456789", "e\u0301"])
def test_dense_scripts_are_resized_once_to_exactly_their_count(renderer, script):
    """The estimate is low for these (2–4 tokens a character); one resize makes the
    reservation exactly what the engine is given."""
    body = {"model": "m", "messages": [{"role": "user", "content": script * (150 // len(script))}], "max_tokens": 1}
    raw_size = len(json.dumps(body, ensure_ascii=False).encode())
    estimate = reserve("chat", dict(body), raw_size, default_max_tokens=64, context_length=None).prompt
    given_tokens, reserved = prompt_tokens_run(renderer, "chat", body)
    assert given_tokens == reserved > estimate
