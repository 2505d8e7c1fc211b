"""Property-based conformance: schemathesis generates requests from OpenAI's
own spec (../shared/openai/openapi.yaml) for createChatCompletion and
createCompletion and sends them, authenticated, to the running stack. Valid
or not, no request may produce a 5xx, and every error must be OpenAI's
envelope. The number of cases is bounded (and derandomized, so a failure
reproduces); the model is pinned to the served one and the token counts are
capped so a case costs milliseconds of generation, not minutes.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from openai_spec import SPEC_PATH

pytestmark = pytest.mark.e2e

CHAT_MODEL = "tiny-llama"
CASES_PER_OPERATION = 40
# Counts that make generation expensive; real requests may use any value.
_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "best_of": 2, "top_logprobs": 20, "logprobs": 5}


@pytest.fixture(scope="module")
def spec():
    return schemathesis.openapi.from_path(SPEC_PATH)


def _served(body):
    """Point the case at the served model and cap its token counts."""
    if not isinstance(body, dict):
        return body
    if "model" in body:
        body["model"] = CHAT_MODEL
    for name, cap in _CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    return body


def _assert_conforms(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"], ids=["createChatCompletion", "createCompletion"])
def test_generated_requests_never_5xx_and_errors_are_enveloped(spec, base_url, api_key, path):
    operation = spec[path]["POST"]
    seen: dict[int, int] = {}

    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def check(case):
        case.body = _served(case.body)
        response = case.call(base_url=f"{base_url}/v1", headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        _assert_conforms(response)

    check()
    # The run must have exercised both sides: served requests and refusals.
    assert seen.get(200), seen
    assert any(400 <= status < 500 for status in seen), seen
