"""vLLM's scoring endpoints through the gateway, with plain HTTP as vLLM
documents them: /score (and /v1/score) and /rerank (Jina's /rerank, /v1/rerank,
Cohere's /v2/rerank) on the embedding model, where vLLM scores a pair by the
cosine similarity of its embeddings: checked against the embeddings the same
stack returns; and on a cross-encoder (replicas/demo_reranker.py), which reads
each pair together: checked against Hugging Face's forward pass of the same
weights. A key, its model list and its token quotas apply: the texts are
charged as prompt tokens."""

from __future__ import annotations

import math

import httpx
import pytest
from http_checks import assert_error_envelope
from settled import wait_until_settled
from stack import create_key

from shared_stack.stack_models import RERANKER

pytestmark = pytest.mark.e2e

EMBEDDING_MODEL = "minilm"
CHAT_MODEL = "tiny-llama"
QUERY = "a red car"
DOCUMENTS = ["the stock market fell sharply", "a crimson automobile parked outside", "a red car"]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / (math.hypot(*a) * math.hypot(*b))


@pytest.fixture(scope="module")
def similarities(http) -> list[float]:
    """The query's cosine similarity to each document, from the stack's own embeddings."""
    response = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": [QUERY, *DOCUMENTS]})
    assert response.status_code == 200, response.text
    query, *documents = [item["embedding"] for item in response.json()["data"]]
    return [cosine(query, document) for document in documents]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_similarity_of_the_embeddings(http, similarities, path):
    response = http.post(path, json={"model": EMBEDDING_MODEL, "queries": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [item["index"] for item in answer["data"]] == [0, 1, 2]
    assert [item["score"] for item in answer["data"]] == pytest.approx(similarities, abs=1e-4)
    assert answer["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_relevance(http, similarities, path):
    response = http.post(path, json={"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    ranked = sorted(range(len(DOCUMENTS)), key=lambda i: -similarities[i])[:2]
    assert [result["index"] for result in results] == ranked == [2, 1]  # the same text first
    assert [result["document"]["text"] for result in results] == [DOCUMENTS[i] for i in ranked]
    assert [result["relevance_score"] for result in results] == pytest.approx(
        [similarities[i] for i in ranked], abs=1e-4
    )


@pytest.fixture(scope="module")
def cross_encoder_scores() -> list[float]:
    """The demo cross-encoder's score of (QUERY, each document), by Hugging Face's
    own forward pass of the weights the replica loads (sigmoid of the one logit,
    as sentence-transformers' CrossEncoder and vLLM score a one-label model)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from replicas.demo_reranker import build_demo_reranker

    path = build_demo_reranker()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    pairs = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return torch.sigmoid(model(**pairs).logits.squeeze(-1)).tolist()


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_a_cross_encoder_scores_each_pair_read_together(http, cross_encoder_scores, path):
    response = http.post(path, json={"model": RERANKER["name"], "queries": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    assert [item["score"] for item in response.json()["data"]] == pytest.approx(cross_encoder_scores, abs=2e-3)
    assert response.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_a_cross_encoder_reranks_by_its_scores(http, cross_encoder_scores, path):
    response = http.post(path, json={"model": RERANKER["name"], "query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [result["index"] for result in results] == sorted(range(3), key=lambda i: -cross_encoder_scores[i])
    assert [result["relevance_score"] for result in results] == pytest.approx(
        sorted(cross_encoder_scores, reverse=True), abs=2e-3
    )


def test_the_cross_encoders_card_says_it_scores_and_reranks(http):
    card = http.get("/v1/models/" + RERANKER["name"])
    assert card.status_code == 200, card.text
    assert {"score", "rerank"} <= set(card.json()["capabilities"]), card.json()
    assert "chat" not in card.json()["capabilities"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/rerank", {"model": CHAT_MODEL, "query": QUERY, "documents": DOCUMENTS}, "model"),  # a chat model
        ("/score", {"model": CHAT_MODEL, "queries": QUERY, "documents": DOCUMENTS}, "model"),
        ("/rerank", {"model": EMBEDDING_MODEL, "documents": DOCUMENTS}, None),  # no query
        ("/rerank", {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": -1}, None),
        ("/rerank", {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "stream": True}, "stream"),
        ("/score", {"model": EMBEDDING_MODEL, "queries": QUERY}, None),
        ("/score", {"model": EMBEDDING_MODEL, "queries": QUERY, "documents": DOCUMENTS, "nope": 1}, None),
        ("/rerank", {"query": QUERY, "documents": DOCUMENTS}, "model"),
    ],
)
def test_bad_scoring_requests_are_a_400(http, path, body, param):
    error = assert_error_envelope(http.post(path, json=body), 400)
    if param is not None:
        assert error["param"] == param, error


def test_scoring_is_charged_its_prompt_tokens_and_counts_against_the_token_quota(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "scoring-quota", tokens_per_minute=400)
    body = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS}
    with httpx.Client(base_url=base_url, timeout=60, headers={"authorization": f"Bearer {secret}"}) as http:
        first = http.post("/rerank", json=body)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["prompt_tokens"]
        # A request whose texts alone are past the minute's tokens is refused before any replica.
        flood = http.post("/rerank", json={**body, "documents": ["a red car " * 40] * 10})
        assert flood.status_code == 429, flood.text
    found = wait_until_settled(redis, key_id)
    assert [(r["status"], int(r["prompt_tokens"])) for r in found] == [("completed", used)]
