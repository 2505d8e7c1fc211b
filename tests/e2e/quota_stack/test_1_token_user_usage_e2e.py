"""An identity token's user is a tenant like a key (serve_app/identity/token_users.py):
on the real stack, a user of the test's identity provider whose team has no API key
at all makes requests with the openai SDK; its usage is then found wherever a key's
is, by its id (``j…``) and its name (``jwt:<user>``): the admin usage route, `llmctl
usage` (alone and as the report's CSV), OpenAI's Usage API grouped by key and by
team (the team's row made of token users only) and its Costs API, every figure
equal to what the SDK was answered and the prices say."""

from __future__ import annotations

import csv
import io
import subprocess
import time

import httpx
import openai
import pytest
from jwks_server import AUDIENCE, ISSUER
from settled import inference, wait_until_settled
from stack import BIN, local_app_args

from quota_stack.stack_args import ADMIN, MODEL, TEAM_CLAIM, USAGE_TEAM
from serve_app.identity.jwt_auth import JwtAuthenticator
from serve_app.settings import JwtConfig

pytestmark = pytest.mark.e2e

ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
HELLO = [{"role": "user", "content": "hi"}]


def today() -> int:
    return int(time.time()) // 86400 * 86400


def admin(method: str, base_url: str, path: str, **kwargs) -> dict:
    response = httpx.request(method, base_url + path, headers=ADMIN_HEADERS, timeout=30, **kwargs)
    assert response.status_code in (200, 201), response.text
    return response.json()


def llmctl(redis_server, *args: str) -> str:
    return subprocess.run(
        [str(BIN / "llmctl"), *args],
        env={"REDIS_URL": redis_server.url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def results(page: dict) -> list[dict]:
    [bucket] = page["data"]  # one day asked for
    return bucket["results"]


def test_a_token_users_usage_is_found_wherever_a_keys_is(base_url, jwks, redis, redis_server):
    tag = time.monotonic_ns()
    team = admin("POST", base_url, "/admin/teams", json={"name": USAGE_TEAM})
    sub = f"fay-{tag}@example.com"
    name = f"jwt:{sub}"
    user = JwtAuthenticator(JwtConfig(issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url))._record({"sub": sub})
    client = openai.OpenAI(
        base_url=base_url + "/v1",
        api_key=jwks.token("k1", sub=sub, **{TEAM_CLAIM: "grp-usage"}),
        max_retries=0,
        timeout=120,
    )
    answers = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3) for _ in range(2)]
    records = inference(wait_until_settled(redis, user.id))
    assert len(records) == 2 and {r["status"] for r in records} == {"completed"}
    prompt = sum(a.usage.prompt_tokens for a in answers)
    completion = sum(a.usage.completion_tokens for a in answers)

    # Today's counters, by id and by name: the admin route and `llmctl usage --key`.
    for who in (user.id, name):
        shown = admin("GET", base_url, f"/admin/keys/{who}/usage")
        assert (shown["id"], shown["key"]) == (user.id, name)
        assert shown["today"]["requests"] == 2 and shown["today"]["tokens"] == prompt + completion
        printed = llmctl(redis_server, "usage", "--key", who)
        assert f'"id": "{user.id}"' in printed and f'"key": "{name}"' in printed

    # OpenAI's Usage API, by key and by team: the team has no key, only this user.
    usage = "/v1/organization/usage/completions"
    by_key = results(admin("GET", base_url, usage, params={"start_time": today(), "group_by": "api_key_id"}))
    [mine] = [row for row in by_key if row["api_key_id"] == user.id]
    assert (mine["num_model_requests"], mine["input_tokens"], mine["output_tokens"]) == (2, prompt, completion)
    by_team = results(
        admin(
            "GET", base_url, usage, params={"start_time": today(), "group_by": "project_id", "project_ids": team["id"]}
        )
    )
    assert [(row["project_id"], row["num_model_requests"]) for row in by_team] == [(team["id"], 2)]

    # Its Costs API: priced at the model's prices.
    [model] = [m for m in local_app_args([MODEL])["models"] if m["name"] == MODEL]
    priced = prompt * model["pricing"]["prompt_per_million"] / 1e6
    priced += completion * model["pricing"]["completion_per_million"] / 1e6
    costs = results(
        admin("GET", base_url, "/v1/organization/costs", params={"start_time": today(), "group_by": "api_key_id"})
    )
    [spent] = [row for row in costs if row["api_key_id"] == user.id]
    assert spent["amount"]["value"] == pytest.approx(priced, rel=1e-6)

    # The report's CSV names the user as it names a key.
    rows = list(csv.DictReader(io.StringIO(llmctl(redis_server, "usage", "--key", name, "--days", "1", "--csv"))))
    assert [(r["key_name"], r["team"], r["num_model_requests"]) for r in rows] == [(name, team["name"], "2")]
