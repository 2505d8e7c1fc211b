"""Validate payloads against OpenAI's official OpenAPI spec (vendored: spec/openai/openapi.yaml).

The spec still carries OpenAPI 3.0's ``nullable: true`` in places although it
declares 3.1; JSON Schema does not know that keyword, so it is rewritten into
a ``null`` alternative before validating.
"""

from __future__ import annotations

import copy
import functools
import json
import pickle
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SPEC_PATH = Path(__file__).resolve().parents[1] / "spec" / "openai" / "openapi.yaml"


def _normalise_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_normalise_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _normalise_nullable(value) for key, value in node.items()}
    if node.pop("nullable", False):
        kind = node.get("type")
        if isinstance(kind, str):
            node["type"] = [kind, "null"]
            if "enum" in node and None not in node["enum"]:
                node["enum"] = [*node["enum"], None]
        elif isinstance(kind, list):
            if "null" not in kind:
                node["type"] = [*kind, "null"]
        else:
            return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def components() -> dict[str, Any]:
    cache = Path("/tmp") / f"openai-spec-{SPEC_PATH.stat().st_mtime_ns}.pickle"
    if cache.exists():
        return pickle.loads(cache.read_bytes())
    spec = yaml.safe_load(SPEC_PATH.read_text())
    result = _normalise_nullable(spec["components"])
    cache.write_bytes(pickle.dumps(result))
    return result


@functools.cache
def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": components()}
    return jsonschema.Draft202012Validator(root)


def validate(payload: dict[str, Any] | str, schema_name: str) -> None:
    """Raise ``jsonschema.ValidationError`` if ``payload`` does not match."""
    if isinstance(payload, str):
        payload = json.loads(payload)
    validator(schema_name).validate(copy.deepcopy(payload))


def errors(payload: dict[str, Any], schema_name: str) -> list[str]:
    return [f"{list(e.path)}: {e.message}" for e in validator(schema_name).iter_errors(payload)]
