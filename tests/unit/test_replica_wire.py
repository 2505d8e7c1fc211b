"""The values that cross a replica call (contract/replica_wire.py): they survive
the pickling a Serve handle call puts them through, cannot be changed on the
way, and read OpenAI's usage object the way settlement needs it."""

import dataclasses
import pickle

import pytest

from contract.replica_wire import ReplicaAnswer, ReplicaError, StreamStart, Usage


@pytest.mark.parametrize(
    "value",
    [
        ReplicaAnswer(b'{"id": "x"}', Usage(3, 4), "replica-1"),
        ReplicaAnswer(b"{}", None, ""),
        ReplicaError(400, {"message": "bad", "param": "n", "code": None}, "replica-1"),
        StreamStart("replica-1", 'data: {"choices": []}\n\n'),
    ],
)
def test_values_survive_pickling_and_are_frozen(value):
    assert pickle.loads(pickle.dumps(value)) == value
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.replica = "other"


def test_usage_from_openai_reads_tokens_and_treats_missing_as_unknown():
    assert Usage.from_openai({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}) == Usage(5, 7)
    assert Usage.from_openai({"prompt_tokens": 5}) == Usage(5, 0)  # embeddings: no completion
    assert Usage.from_openai({"prompt_tokens": None, "completion_tokens": 2}) == Usage(0, 2)
    assert Usage.from_openai(None) is None and Usage.from_openai({}) is None  # unknown ≠ zero


async def test_a_replica_stream_starts_with_its_replica_then_relays_text():
    from contract.replica_wire import as_replica_stream

    async def texts():
        for text in ("a", "b", "c"):
            yield text

    assert [item async for item in as_replica_stream("r1", texts())] == [StreamStart("r1", "a"), "b", "c"]


def test_the_gateway_and_the_replica_name_the_same_operations():
    """One list (contract/replica_wire.py ReplicaOperation): every operation the gateway
    sends, and every endpoint the replica binds, is on it, and each is used."""
    import ast
    from pathlib import Path

    from contract.replica_wire import REPLICA_OPERATIONS
    from serve_app.wire.api_requests import OPERATIONS, TEMPLATED_COMPLETIONS

    sent = {op.replica_operation for op in (*OPERATIONS.values(), TEMPLATED_COMPLETIONS)}
    # The names replicas/vllm_engine.py's endpoints binds (found["..."] = ...), read from its source.
    source = ast.parse((Path(__file__).resolve().parents[2] / "replicas" / "vllm_engine.py").read_text())
    [endpoints] = [node for node in ast.walk(source) if isinstance(node, ast.FunctionDef) and node.name == "endpoints"]
    bound = {
        target.slice.value
        for node in ast.walk(endpoints)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
    }
    assert sent == REPLICA_OPERATIONS == bound
