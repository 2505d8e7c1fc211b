"""The reservation bounds every pooled prompt on the real stack (vLLM's CPU engine,
MiniLM's WordPiece tokenizer, the demo cross-encoder; /v1/embeddings in one hop to
MiniLM's replica as configs/local.yaml ships it, /v1/score and /v1/rerank through the
ingress): a hostile tenant's concurrent bursts of punctuation runs (a token a byte for
WordPiece: four times the gateway's estimate) as a text, as a list of texts, as a
bi-encoder's score and as a cross-encoder's pairs, against a key's and a team's daily
token budget, are never charged past it, and every request record is charged at most
what it reserved (docs/quotas.md, "The reservation bounds every prompt"). Asserted on
what Redis charged. Before the count was carried onto vLLM's renderer threads a key of
1,000 tokens was charged 1,631 for embeddings and 2,824 for lists of them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
from dense_prompts import burst
from settled import assert_within_reservations, counters, wait_until_settled
from stack import create_key

from shared_stack.stack_models import RERANKER

pytestmark = pytest.mark.e2e

EMBEDDING_MODEL = "minilm"
BUDGET = 1_000
DENSE = "!?"  # WordPiece splits each punctuation character: one token a byte of JSON


def embeddings(client, prompt):
    return client.embeddings.create(model=EMBEDDING_MODEL, input=prompt).usage


def pooled(path: str, model: str, **fields):
    """A sender of ``path`` (vLLM's score or rerank body) whose documents are the prompt."""

    def send(client, prompt):
        answer = client.post(path, body={"model": model, **fields, "documents": prompt}, cast_to=object)
        return SimpleNamespace(**answer["usage"])

    return send


SENDS = {
    "embeddings of a text": (embeddings, [DENSE * 100, DENSE * 90]),
    "embeddings of a list": (embeddings, [[DENSE * 40] * 4, [DENSE * 35] * 4]),
    "bi-encoder score": (pooled("/score", EMBEDDING_MODEL, queries=DENSE * 20), [[DENSE * 30] * 4]),
    "cross-encoder rerank": (pooled("/rerank", RERANKER["name"], query=DENSE * 20), [[DENSE * 30] * 4]),
}


def assert_held(redis, account_id: str, key_ids: list[str], answered: list) -> None:
    """Charged what was answered and never past the budget; every record within its reservation."""
    assert answered, "the budget holds at least one such request"
    assert_within_reservations([record for key_id in key_ids for record in wait_until_settled(redis, key_id)])
    wait_until_settled(redis, account_id)
    charged = counters(redis, account_id)
    assert charged["tokens"] == sum(usage.total_tokens for usage in answered)
    assert charged["tokens"] <= BUDGET, (charged, len(answered))


@pytest.mark.parametrize("what", SENDS)
def test_a_keys_daily_budget_holds_against_dense_pooled_prompts(base_url, redis_server, redis, what):
    send, prompts = SENDS[what]
    key_id, secret = create_key(redis_server.url, f"dense-pool-{time.monotonic_ns()}", daily_token_budget=BUDGET)
    answered = burst(base_url, [secret], prompts, send=send, clients=16)
    assert_held(redis, key_id, [key_id], answered)


@pytest.mark.parametrize("what", ["embeddings of a list", "cross-encoder rerank"])
def test_a_teams_daily_budget_holds_against_two_keys_of_it_bursting(base_url, admin_token, redis, what):
    send, prompts = SENDS[what]
    tag = time.monotonic_ns()
    admin = httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_token}"}, timeout=30)
    team = admin.post("/admin/teams", json={"name": f"dense-pool-{tag}", "daily_token_budget": BUDGET}).json()
    keys = [admin.post("/admin/keys", json={"name": f"pool-{tag}-{i}", "team": team["id"]}).json() for i in (0, 1)]
    answered = burst(base_url, [key["secret"] for key in keys], prompts, send=send, clients=32)
    assert_held(redis, team["id"], [key["id"] for key in keys], answered)
