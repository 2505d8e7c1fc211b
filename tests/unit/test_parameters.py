"""Pure logic: parameters vLLM lacks are dropped (documented) or refused, never silently ignored."""

import pytest

from serve_app.errors import OpenAIError
from serve_app.wire.parameters import IGNORED, UNSUPPORTED, apply_parameter_policy


def test_ignored_parameters_are_dropped_and_the_rest_kept():
    body = {"model": "m", "messages": [], "metadata": {"a": "b"}, "service_tier": "auto", "top_k": 3}
    apply_parameter_policy("chat", body)
    assert body == {"model": "m", "messages": [], "top_k": 3}


@pytest.mark.parametrize(
    "operation, params",
    [
        ("chat", {"store": False}),
        ("chat", {"modalities": ["text"]}),
        ("chat", {"typical_p": None}),
        ("completions", {"best_of": 1}),
        ("completions", {"use_beam_search": False}),
        ("chat", {"use_beam_search": False}),
        ("embeddings", {"stream": False}),
    ],
)
def test_off_values_pass_and_are_removed(operation, params):
    body = dict(params)
    apply_parameter_policy(operation, body)
    assert body == {}


@pytest.mark.parametrize(
    "operation, params, param",
    [
        ("chat", {"typical_p": 0.9}, "typical_p"),
        ("chat", {"store": True}, "store"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"functions": []}, "functions"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"use_beam_search": True}, "use_beam_search"),
        ("chat", {"use_beam_search": True}, "use_beam_search"),
        ("chat", {"use_beam_search": 1}, "use_beam_search"),
        ("chat", {"top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": -1}, "top_logprobs"),
        ("chat", {"top_logprobs": True}, "top_logprobs"),
    ],
)
def test_unsupported_values_are_400_naming_the_parameter(operation, params, param):
    with pytest.raises(OpenAIError) as caught:
        apply_parameter_policy(operation, dict(params))
    assert caught.value.status == 400 and caught.value.param == param


def test_no_parameter_is_both_ignored_and_unsupported():
    for operation in IGNORED:
        assert not IGNORED[operation] & UNSUPPORTED[operation].keys()


def test_llamacpp_names_become_vllms():
    body = {
        "repeat_penalty": 1.1,
        "n_predict": 12,
        "top_k": 40,
        "min_p": 0.05,
        "cache_prompt": True,
        "repeat_last_n": 64,
    }
    apply_parameter_policy("chat", body)
    assert body == {"repetition_penalty": 1.1, "max_tokens": 12, "top_k": 40, "min_p": 0.05}


def test_conflicting_alias_is_400():
    with pytest.raises(OpenAIError) as caught:
        apply_parameter_policy("completions", {"repeat_penalty": 1.1, "repetition_penalty": 1.3})
    assert caught.value.param == "repeat_penalty"


@pytest.mark.parametrize("params", [{"mirostat": 0}, {"tfs_z": 1.0}, {"typical_p": 1}, {"dry_multiplier": 0}])
def test_llamacpp_samplers_switched_off_pass(params):
    body = dict(params)
    apply_parameter_policy("completions", body)
    assert body == {}


@pytest.mark.parametrize(
    "params, param",
    [
        ({"mirostat": 2}, "mirostat"),
        ({"mirostat_tau": 5.0}, "mirostat_tau"),
        ({"tfs_z": 0.9}, "tfs_z"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
    ],
)
def test_llamacpp_samplers_in_use_are_400(params, param):
    with pytest.raises(OpenAIError) as caught:
        apply_parameter_policy("chat", dict(params))
    assert caught.value.param == param
