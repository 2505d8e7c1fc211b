"""The fields the gateway sets on a replica call (serve_app/pipeline/replica_request.py),
and that nothing else on the path writes the client's body: the gateway's own fields
are listed in one class, written into a copy once, on the way out."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
from cache_secret import salts
from test_cache_isolation import RecordingHandle
from test_gateway_run import Access

from contract.model_config import ModelConfig
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.pipeline.replica_request import GATEWAY_FIELDS, GatewayFields, replica_body
from serve_app.telemetry import RequestRecord, Telemetry

ROOT = Path(__file__).resolve().parents[2]
KEY = KeyRecord(id="k1", name="a", created_at=0, priority="high")
CHAT = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"continuous": True}}

# The path from a planned request to its replica call: none of it writes a body but
# replica_request.py. (The translations before it, the dialects and the Responses API,
# build the client's body; the parameter policy and the validation make it canonical;
# the edge router salts its own copy to route it.)
ON_THE_PATH = [
    *sorted((ROOT / "serve_app" / "pipeline").glob("*.py")),
    *sorted((ROOT / "serve_app" / "admission").glob("*.py")),
    ROOT / "serve_app" / "wire" / "reservation.py",
]
WRITES = {"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__"}


def _is_body(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "body") or (
        isinstance(node, ast.Attribute) and node.attr == "body"
    )


def body_writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_body(target.value):
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call):
            method = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if method in WRITES and _is_body(node.func.value):  # type: ignore[union-attr]
                found.append(f"{path.name}:{node.lineno}")
            if (isinstance(node.func, ast.Name) and node.func.id == "put_salt") or method == "put_salt":
                found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", [p for p in ON_THE_PATH if p.name != "replica_request.py"], ids=lambda p: p.name)
def test_nothing_on_the_path_writes_the_clients_body(path):
    assert not body_writes(path), "set the field in replica_request.GatewayFields instead"


def test_the_check_sees_each_way_of_writing_a_body(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        'body["priority"] = 1\nplan.body["request_id"] = "r"\nbody.pop("cache_salt")\n'
        'del body["model"]\nput_salt(body, None)\nbody["stream_options"] |= {}\n'
    )
    assert len(body_writes(planted)) == 6


def test_the_gateways_fields_are_the_listed_ones_and_the_clients_body_is_left_as_it_is():
    body = {"model": "alias", "cache_salt": "mine", "priority": -5, "stream_options": {"x": 1}}
    before = copy.deepcopy(body)
    fields = GatewayFields("m", "max_tokens", 64, 0, True, "salt", "req-1", include_usage=True)
    sent = replica_body(body, fields)
    assert body == before  # a copy is written, never the client's
    changed = {name for name in set(sent) | set(body) if sent.get(name) != body.get(name)}
    assert changed == {"model", "max_tokens", "priority", "cache_salt", "request_id", "stream_options"}
    assert changed <= set(GATEWAY_FIELDS)
    assert sent["stream_options"] == {"x": 1, "include_usage": True}
    unsalted = replica_body(body, GatewayFields("m", salted=True))
    assert "cache_salt" not in unsalted  # everyone's cache: the client's own salt never passes
    assert replica_body(body, GatewayFields("m"))["cache_salt"] == "mine"  # an unsalted operation: as sent


async def test_a_run_sends_the_gateways_fields_and_leaves_the_callers_body_unchanged():
    calls: list = []
    config = ModelConfig(name="m", aliases=["alias"], engine_kwargs={"scheduling_policy": "priority"})
    gateway = Gateway(Access(), {"m": RecordingHandle(calls)}, [config], Telemetry(False, False), salts())
    body = json.loads(json.dumps(CHAT))
    await gateway.run(KEY, "chat", body, 100, RequestRecord("openai", "x"))
    sent, _ = calls[-1]
    assert sent["model"] == "m" and sent["priority"] == 0 and sent["max_tokens"] == 16  # the default, named
    assert len(sent["cache_salt"]) == 43 and sent["request_id"] == "req-1"  # the ticket's id
    assert {name for name in sent if sent[name] != body.get(name)} == {
        "model",
        "max_tokens",
        "priority",
        "cache_salt",
        "request_id",
    }
    assert body == CHAT  # the caller's body, as it sent it
