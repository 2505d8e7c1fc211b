"""Pure logic: what a client may send as `model` and what it reaches
(configured name, alias, LoRA adapter name, '<model>:<adapter folder>')."""

import pytest

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
    return Gateway(access=None, models={}, configs=CONFIGS, telemetry=None)


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
    ["nope", "tiny:pirate", "named-only:x", "small:", "small:../etc", "small:a/b", "small:.hidden", ":small", "small:pirate:x"],
)
def test_anything_else_is_404_model_not_found(gateway, sent):
    with pytest.raises(OpenAIError) as caught:
        gateway.catalog.target(sent)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
