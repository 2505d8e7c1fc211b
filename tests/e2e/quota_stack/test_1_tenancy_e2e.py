"""What a tenant's key may see of the cluster, on the real stack: a model its team may
not use is never listed, described, picked or named for it, on OpenAI's routes and
Azure's; a key of a disabled team is a 401 on every route that names models, as on
inference (docs/quotas.md, "Teams")."""

from __future__ import annotations

import time

import httpx
import pytest

from quota_stack.stack_args import MODEL, NARROW, NARROW_ALIAS
from quota_stack.test_1_teams_e2e import admin

pytestmark = pytest.mark.e2e


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def test_a_teams_model_restriction_applies_to_every_listing_card_and_info(base_url):
    tag = time.monotonic_ns()
    team = admin("POST", base_url, "/admin/teams", name=f"narrow-only-{tag}", models=[NARROW])
    key = admin("POST", base_url, "/admin/keys", name=f"narrow-only-{tag}", team=team["id"])
    with httpx.Client(base_url=base_url, headers=bearer(key["secret"]), timeout=60) as http:
        listed = {model["id"] for model in http.get("/v1/models").json()["data"]}
        assert listed == {NARROW, NARROW_ALIAS}, listed
        assert http.get(f"/v1/models/{NARROW}").status_code == 200
        hidden = http.get(f"/v1/models/{MODEL}")
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
        # Azure's /info with no deployment named: the one model this key may use, no other named.
        info = http.get("/info")
        assert info.status_code == 200 and info.json()["model_name"] == NARROW, info.text
        assert http.get("/info", headers={"azureml-model-deployment": MODEL}).status_code == 404
        refused = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_a_key_of_a_disabled_team_is_a_401_on_every_route_that_names_models(base_url):
    tag = time.monotonic_ns()
    team = admin("POST", base_url, "/admin/teams", name=f"gone-{tag}")
    key = admin("POST", base_url, "/admin/keys", name=f"gone-{tag}", team=team["id"])
    routes = ["/v1/models", f"/v1/models/{MODEL}", "/info", "/models/info"]
    with httpx.Client(base_url=base_url, headers=bearer(key["secret"]), timeout=60) as http:
        assert [http.get(route).status_code for route in routes[:2]] == [200, 200]
        admin("DELETE", base_url, f"/admin/teams/{team['id']}")
        deadline = time.monotonic() + 10  # each ingress replica's team cache (key_cache_ttl_s)
        while True:
            statuses = [http.get(route).status_code for route in routes]
            if statuses == [401] * len(routes) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert statuses == [401] * len(routes), statuses
        chat = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 401
