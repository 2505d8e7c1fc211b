"""Pure logic: what a client may send as `model` and what it reaches
(configured name, alias, LoRA adapter name, '<model>:<adapter folder>')."""

import pytest
from cache_secret import salts

from contract.model_config import ModelConfig
from serve_app.errors import OpenAIError
from serve_app.pipeline.gateway import Gateway

CONFIGS = [
    ModelConfig(name="tiny", aliases=["chat-default"]),
    ModelConfig(name="small", source="demo:small", lora={"adapters": {"pirate": "demo"}, "dir": "/adapters"}),
    ModelConfig(name="named-only", lora={"adapters": {"x": "/x"}}),
]


@pytest.fixture
def gateway():
    return Gateway(access=None, models={}, configs=CONFIGS, telemetry=None, salts=salts())


@pytest.mark.parametrize(
    "sent, reached",
    [
        ("tiny", ("tiny", None)),
        ("chat-default", ("tiny", None)),
        ("small", ("small", None)),
        ("pirate", ("small", "pirate")),
        ("small:my-adapter_2.1", ("small", "small:my-adapter_2.1")),
        ("x", ("named-only", "x")),
    ],
)
def test_names_reach_their_model_and_adapter(gateway, sent, reached):
    assert gateway.catalog.target(sent) == reached


@pytest.mark.parametrize(
    "sent",
    [
        "nope",
        "tiny:pirate",
        "named-only:x",
        "small:",
        "small:../etc",
        "small:a/b",
        "small:.hidden",
        ":small",
        "small:pirate:x",
    ],
)
def test_anything_else_is_404_model_not_found(gateway, sent):
    with pytest.raises(OpenAIError) as caught:
        gateway.catalog.target(sent)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config.name)
def test_a_model_names_its_own_adapters_as_the_catalog_does_and_lists_what_clients_may_send(gateway, config):
    """``adapter_named`` is what the edge router (serve_app/http/edge_router.py) routes an
    adapter by; ``client_names`` what the edge sends to a direct route in one hop."""
    whole, beginnings = config.client_names()
    for sent in [*whole, "small:my-adapter_2.1", "small:../etc", "tiny:pirate", "nope"]:
        try:
            model, adapter = gateway.catalog.target(sent)
        except OpenAIError:
            model, adapter = None, None
        assert config.adapter_named(sent) == (adapter if model == config.name else None), sent
        # Every name of the model is listed; a beginning may match more (its route answers the rest's 404).
        assert (sent in whole) <= (model == config.name) <= (sent in whole or sent.startswith(tuple(beginnings))), sent
