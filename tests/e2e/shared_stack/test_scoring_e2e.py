"""vLLM's scoring endpoints through the gateway, with plain HTTP as vLLM
documents them: /score (and /v1/score) and /rerank (Jina's /rerank, /v1/rerank,
Cohere's /v2/rerank) on the embedding model, where vLLM scores a pair by the
cosine similarity of its embeddings: checked against the embeddings the same
stack returns. A key, its model list and its token quotas apply: the texts are
charged as prompt tokens."""

from __future__ import annotations

import math

import httpx
import pytest

from http_checks import assert_error_envelope
from settled import wait_until_settled
from stack import create_key

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
        [similarities[i] for i in ranked], abs=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"model": CHAT_MODEL, "query": QUERY, "documents": DOCUMENTS}, "model"),  # a chat model
    ("/score", {"model": CHAT_MODEL, "queries": QUERY, "documents": DOCUMENTS}, "model"),
    ("/rerank", {"model": EMBEDDING_MODEL, "documents": DOCUMENTS}, None),  # no query
    ("/rerank", {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": -1}, None),
    ("/rerank", {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "stream": True}, "stream"),
    ("/score", {"model": EMBEDDING_MODEL, "queries": QUERY}, None),
    ("/score", {"model": EMBEDDING_MODEL, "queries": QUERY, "documents": DOCUMENTS, "nope": 1}, None),
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS}, "model"),
])
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
