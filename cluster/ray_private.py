"""What the local node provider uses of Ray's autoscaler that Ray has not made public,
in one place: the fake multi-node provider it extends, the helper that prefixes a
command with its environment, and the error a failed command raises. Only this
module imports ``ray.autoscaler._private`` (tests/unit/test_boundaries.py), so a Ray
upgrade that moves them breaks here alone."""

from __future__ import annotations

from ray.autoscaler._private.command_runner import _with_environment_variables as with_environment_variables
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError

__all__ = ["FakeMultiNodeProvider", "ProcessRunnerError", "head_node_id", "node_table", "with_environment_variables"]


def node_table(provider: FakeMultiNodeProvider) -> dict:
    """The fake provider's nodes by id, each ``{"tags": ...}`` (``provider._nodes``;
    hold ``provider.lock`` to change it). Read against Ray 2.60.0."""
    return provider._nodes


def head_node_id(provider: FakeMultiNodeProvider) -> str:
    """The id the fake provider gave the head (``provider._head_node_id``)."""
    return provider._head_node_id
