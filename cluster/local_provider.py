"""Ray's fake multi-node provider, driven by `ray up` / `ray down` on one machine.

``cluster.local.yaml`` names this provider (``type: external``). Ray ships the
fake multi-node provider to test its autoscaler on a laptop: "worker nodes" are
extra raylets on this machine carrying the resources of their node type, which
the autoscaler starts and stops exactly as it starts and stops cloud instances.
Ray made it for ``ray start --autoscaling-config``; two gaps keep ``ray up``
from driving it, and they are all this module fills:

- the head node is this machine, so what ``ray up`` would run on it over SSH
  (file mounts, setup and start commands) runs in a local shell;
- ``ray up`` tags the head as it sets it up, which the fake provider refuses.

Everything else (worker launch, idle termination, resource accounting) is Ray's
own code, so the local twin exercises the same autoscaler as cluster.yaml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

from cluster.ray_private import (
    FakeMultiNodeProvider,
    ProcessRunnerError,
    head_node_id,
    node_table,
    with_environment_variables,
)


class LocalCommandRunner(CommandRunnerInterface):
    """Runs a node's commands in a local shell; "remote" paths are local ones."""

    def run(
        self,
        cmd: str | None = None,
        timeout: int = 120,
        exit_on_fail: bool = False,
        port_forward=None,
        with_output: bool = False,
        environment_variables: dict[str, Any] | None = None,
        run_env: str = "auto",
        ssh_options_override_ssh_key: str = "",
        shutdown_after_run: bool = False,
    ) -> str:
        if not cmd:
            return ""
        if environment_variables:
            cmd = with_environment_variables(cmd, environment_variables)
        result = subprocess.run(["bash", "-c", cmd], capture_output=with_output, text=True)
        if result.returncode != 0:
            raise ProcessRunnerError("Command failed", "local_command_failed", code=result.returncode, command=cmd)
        return result.stdout if with_output else ""

    def run_rsync_up(self, source: str, target: str, options=None) -> None:
        _copy(source, target)

    def run_rsync_down(self, source: str, target: str, options=None) -> None:
        _copy(source, target)

    def remote_shell_command_str(self) -> str:
        return "bash"

    def run_init(self, *, as_head: bool, file_mounts: dict[str, str], sync_run_yet: bool):
        return None


def _copy(source: str, target: str) -> None:
    src, dst = Path(os.path.expanduser(source)), Path(os.path.expanduser(target.rstrip("/")))
    if src.resolve() == dst.resolve():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


class LocalFakeClusterProvider(FakeMultiNodeProvider):
    """FakeMultiNodeProvider with this machine as the head that `ray up` sets up
    and `ray down` stops (its Ray processes, fake workers included, by `ray stop`)."""

    def create_node(self, node_config, tags, count):
        # `ray up` "launches" a head: the head is this machine, adopt it.
        with self.lock:
            node_table(self)[head_node_id(self)] = {"tags": dict(tags)}

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        if tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD:
            return self.create_node(node_config, tags, count)
        return super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)

    def terminate_node(self, node_id):
        if node_id == head_node_id(self):
            # The machine stays; `ray down` stops its Ray processes with `ray stop`.
            with self.lock:
                node_table(self).pop(node_id, None)
            return
        super().terminate_node(node_id)

    def get_command_runner(
        self, log_prefix, node_id, auth_config, cluster_name, process_runner, use_internal_ip, docker_config=None
    ) -> CommandRunnerInterface:
        return LocalCommandRunner()

    def set_node_tags(self, node_id, tags) -> None:
        with self.lock:
            node_table(self)[node_id]["tags"].update(tags)
