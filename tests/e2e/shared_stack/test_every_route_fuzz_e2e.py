"""Every route the ingress serves, fuzzed as a hostile client would fuzz it, on the
real stack: walked from the ingress' route table (``ROUTE_ACCESS``: OpenAI's,
Anthropic's, vLLM's, the dialects', the admin API, the console), each gets
generated path parameters, query strings and bodies — JSON of every type and
depth with the field names the gateway reads (huge and negative numbers, wrong
types, lists where objects go), arbitrary bytes under JSON, form and multipart
content types — with the credential its access needs (and sometimes a wrong
one). Whatever is sent, no answer is a 5xx, and an error is a JSON envelope
with an ``error`` (the console's forms answer pages; they are held to the
status alone).

test_conformance_e2e.py generates from the routes' published schemas (OpenAI's
spec, the dialects'); this module covers every route, schema or not. A body
naming a model is pointed at a served one half the time and its token counts
capped (a case costs milliseconds of generation), so cases get past the model
lookup into parameters, media, admission and the engine.
`FUZZ_CASES=60 pytest tests/e2e/shared_stack/test_every_route_fuzz_e2e.py` runs
a larger draw; the seed is fixed (FUZZ_SEED) so a failure replays.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from serve_app.http.ingress import ROUTE_ACCESS
from shared_stack.test_conformance_e2e import CHAT_MODEL, EMBEDDING_MODEL, capped

pytestmark = pytest.mark.e2e

CASES_PER_ROUTE = int(os.environ.get("FUZZ_CASES", "12"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))

# Field names the gateway, its dialects and its admin API read: generated
# bodies use them, so cases reach the checks behind the first "unknown field".
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "inputs",
    "parameters",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "max_new_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "include_usage",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "user",
    "metadata",
    "previous_response_id",
    "store",
    "instructions",
    "text",
    "reasoning",
    "role",
    "content",
    "type",
    "image_url",
    "url",
    "system",
    "encoding_format",
    "dimensions",
    "query",
    "documents",
    "text_1",
    "text_2",
    "tokens",
    "purpose",
    "file",
    "input_file_id",
    "endpoint",
    "completion_window",
    "name",
    "team",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "models",
    "priority",
    "tier",
    "daily_token_budget",
    "monthly_token_budget",
    "daily_cost_budget_usd",
    "enabled",
    "expires_at",
    "token",
]
QUERY_NAMES = [
    "limit",
    "after",
    "before",
    "order",
    "purpose",
    "key",
    "team",
    "actor",
    "target",
    "start_time",
    "end_time",
    "bucket_width",
    "group_by",
    "models",
    "project_ids",
    "api_key_ids",
    "page",
    "days",
    "include",
    "api-version",
]
SERVED_MODELS = [CHAT_MODEL, EMBEDDING_MODEL]

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=24),
)
_json = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)), inner, max_size=5),
    ),
    max_leaves=24,
)
_objects = st.dictionaries(st.sampled_from(FIELDS), _json, max_size=7)


@st.composite
def bodies(draw) -> tuple[bytes | None, str | None]:
    """(the body, its content type)."""
    kind = draw(st.sampled_from(["object", "object", "object", "json", "bytes", "form", "multipart", "none"]))
    if kind == "object":
        body = draw(_objects)
        if "model" in body and draw(st.booleans()):
            body["model"] = draw(st.sampled_from(SERVED_MODELS))
        body = capped(body, body.get("model"))
        return json.dumps(body).encode(), "application/json"
    if kind == "json":
        return json.dumps(draw(_json)).encode(), "application/json"
    if kind == "bytes":
        return draw(st.binary(max_size=96)), draw(st.sampled_from(["application/json", "text/plain", None]))
    if kind == "form":
        fields = draw(st.dictionaries(st.sampled_from(FIELDS), st.text(max_size=16), max_size=4))
        return "&".join(
            f"{quote(k)}={quote(v)}" for k, v in fields.items()
        ).encode(), "application/x-www-form-urlencoded"
    if kind == "multipart":
        part = draw(st.binary(max_size=64))
        name = draw(st.sampled_from(["file", "purpose", "x", ""]))
        raw = (
            b'--b\r\nContent-Disposition: form-data; name="'
            + name.encode()
            + b'"; filename="a.jsonl"\r\n\r\n'
            + part
            + b"\r\n--b--\r\n"
        )
        return draw(st.sampled_from([raw, raw[:-8], part])), "multipart/form-data; boundary=b"
    return None, None


_PARAM = re.compile(r"\{(\w+)(?::path)?\}")


@st.composite
def requests_for(draw, path: str):
    """(the path with its parameters filled, the query string)."""

    def fill(match: re.Match) -> str:
        if match.group(1) in ("model_id", "name") and draw(st.booleans()):
            return draw(st.sampled_from(SERVED_MODELS))
        return quote(draw(st.text(min_size=1, max_size=20)), safe="")

    filled = _PARAM.sub(fill, path)
    query = draw(
        st.dictionaries(st.one_of(st.sampled_from(QUERY_NAMES), st.text(max_size=5)), st.text(max_size=12), max_size=3)
    )
    return filled, query


def credential(access: str, api_key: str, admin_token: str, wrong: bool) -> dict[str, str]:
    if wrong:
        return {"authorization": "Bearer sk-" + "0" * 40}
    token = {"key": api_key, "admin": admin_token}.get(access)
    return {"authorization": f"Bearer {token}"} if token else {}


@pytest.mark.parametrize("method, path", sorted(ROUTE_ACCESS))
def test_no_request_on_any_route_is_a_5xx(base_url, api_key, admin_token, method, path):
    access = ROUTE_ACCESS[(method, path)]
    seen: dict[int, int] = {}

    @settings(max_examples=CASES_PER_ROUTE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @seed(SEED)
    @given(target=requests_for(path), body=bodies(), wrong=st.sampled_from([False, False, False, True]))
    def check(target, body, wrong):
        url, query = target
        raw, content_type = body
        headers = credential(access, api_key, admin_token, wrong)
        if content_type:
            headers["content-type"] = content_type
        response = http.request(
            method, url, params=query, headers=headers, content=raw if method in ("POST", "PATCH", "PUT") else None
        )
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (
            f"{method} {url} {query} {raw!r:.300}: {response.status_code} {response.text[:300]}"
        )
        if response.status_code >= 400 and access != "console":
            assert response.headers.get("content-type", "").startswith("application/json"), response.text[:300]
            assert "error" in response.json(), response.text[:300]

    with httpx.Client(base_url=base_url, timeout=120) as http:
        check()
    print(f"{method} {path}: {dict(sorted(seen.items()))}")
