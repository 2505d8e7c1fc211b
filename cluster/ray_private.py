"""What the local node provider uses of Ray's autoscaler that Ray has not made public,
in one place: the fake multi-node provider it extends, the helper that prefixes a
command with its environment, and the error a failed command raises. Only this
module imports ``ray.autoscaler._private`` (tests/unit/test_boundaries.py), so a Ray
upgrade that moves them breaks here alone."""

from __future__ import annotations

from ray.autoscaler._private.command_runner import _with_environment_variables as with_environment_variables
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError

__all__ = ["FakeMultiNodeProvider", "ProcessRunnerError", "with_environment_variables"]
