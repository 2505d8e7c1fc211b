"""Where the gateway's CPU goes, by measurement: `py-spy record` on each Python
process a request crosses (Ray's proxy when it is the ingress, our ingress
replica, the model replica with vLLM's front end) while a load runs, and the
CPU time each process spent over the requests and tokens it relayed; counted
beside them, not sampled: vLLM's engine and Ray's daemons, so that the table
shows what else takes the box's CPU while tokens stream.

Used by serving_overhead.py (``--profile DIR``) and gateway_capacity.py
(``--profile DIR``): they drive the load; this module samples and summarises.
The raw profiles (py-spy's collapsed stacks, one file per process) stay in DIR
for flame graphs (`flamegraph.pl`, speedscope)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Which processes a figure belongs to, by what their command line (Ray's process
# title) holds. HAProxy itself is C: its CPU is counted, it is not sampled.
GROUPS = {
    "proxy": ("ray::ProxyActor", "haproxy -db"),
    "ingress": ("ServeReplica:llm:Ingress",),
    "replica": ("ServeReplica:llm:model-",),
    "engine": ("VLLM::EngineCore", "VLLM::Worker"),  # for scale; the engine is vLLM's, not sampled
    # Counted, not sampled: Ray's daemons and Serve's control actors, off the request
    # path but on the engine's cores on a small node (bare vLLM has none).
    "ray daemons": (
        "gcs_server",
        "raylet/raylet",
        "ray::DashboardAgent",
        "ray::RuntimeEnvAgent",
        "ray/dashboard/dashboard.py",
        "ray-dashboard-",
        "_private/log_monitor.py",
        "autoscaler/_private/monitor.py",
        "ray::ServeController",
        "ray::HAProxyManager",
    ),
}
NOT_SAMPLED = {"engine", "ray daemons"}
SAMPLE_RATE_HZ = 200
# A frame as py-spy's raw format writes it: "function (path/to/file.py:123)".
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


@dataclass
class HopProfile:
    group: str
    cpu_s: float = 0.0
    samples: int = 0
    by_function: Counter = field(default_factory=Counter)  # self samples per "function (file)"
    by_package: Counter = field(default_factory=Counter)  # self samples per top-level package


def processes(groups: dict[str, tuple[str, ...]] = GROUPS) -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {group: [] for group in groups}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        for group, marks in groups.items():
            if any(mark in cmdline for mark in marks):
                found[group].append(proc)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _is_python(proc: psutil.Process) -> bool:
    try:
        return "python" in Path(proc.exe()).name or proc.cmdline()[0].startswith("ray::")
    except (psutil.Error, IndexError):
        return False


@contextmanager
def profiled(out_dir: Path, groups: dict[str, tuple[str, ...]] = GROUPS):
    """Sample every Python process of ``groups`` while the body runs; yields a
    dict that holds one HopProfile per group afterwards."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    out_dir.mkdir(parents=True, exist_ok=True)
    found = processes(groups)
    recorders: list[tuple[str, Path, subprocess.Popen]] = []
    for group, procs in found.items():
        for proc in procs:
            if group in NOT_SAMPLED or not _is_python(proc):
                continue
            path = out_dir / f"{group}-{proc.pid}.txt"
            recorder = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--rate",
                    str(SAMPLE_RATE_HZ),
                    "--format",
                    "raw",
                    "--output",
                    str(path),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            recorders.append((group, path, recorder))
    time.sleep(1.0)  # py-spy attaches
    before = {group: cpu_seconds(procs) for group, procs in found.items()}
    result: dict[str, HopProfile] = {}
    try:
        yield result
    finally:
        after = {group: cpu_seconds(procs) for group, procs in found.items()}
        for _, _, recorder in recorders:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for _, _, recorder in recorders:
            try:
                recorder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                recorder.kill()
        for group in found:
            result[group] = HopProfile(group, cpu_s=after[group] - before[group])
        for group, path, _ in recorders:
            if path.exists():
                _add_samples(result[group], path.read_text())


def _add_samples(profile: HopProfile, collapsed: str) -> None:
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        function, package = _name(leaf)
        profile.samples += int(count)
        profile.by_function[function] += int(count)
        profile.by_package[package] += int(count)


def _name(frame: str) -> tuple[str, str]:
    """("function (file.py)", package) of one frame."""
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip(), "?"
    path = match["path"]
    parts = Path(path).parts
    if "site-packages" in parts:
        package = parts[parts.index("site-packages") + 1]
    elif "lib" in parts and any(p.startswith("python3") for p in parts):
        package = "stdlib:" + Path(path).stem
    else:
        package = next((p for p in parts if p in ("serve_app", "replicas", "contract", "bench")), Path(path).stem)
    return f"{match['function']} ({Path(path).name})", package.removesuffix(".py")


def report(profiles: dict[str, HopProfile], requests: int, tokens: int, top: int = 8) -> str:
    """A Markdown table of CPU per request and per token for each hop, then each
    hop's heaviest packages and functions by self time (share of its samples)."""
    lines = ["| process | CPU s | CPU µs/request | CPU µs/token |", "|---|---|---|---|"]
    for profile in profiles.values():
        if not profile.cpu_s and not profile.samples:
            continue  # no such process in this target (e.g. no engine behind a fake one)
        lines.append(
            f"| {profile.group} | {profile.cpu_s:.1f} | {profile.cpu_s * 1e6 / max(requests, 1):,.0f} | "
            f"{profile.cpu_s * 1e6 / max(tokens, 1):,.1f} |"
        )
    for profile in profiles.values():
        if not profile.samples:
            continue
        lines += [
            "",
            f"{profile.group}: {profile.samples} samples; self time by package: "
            + ", ".join(
                f"{package} {count / profile.samples:.0%}" for package, count in profile.by_package.most_common(top)
            ),
        ]
        lines += [
            f"  {count / profile.samples:6.1%}  {function}" for function, count in profile.by_function.most_common(top)
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    # Ad hoc: profile whatever stack runs on this machine for N seconds.
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20
    with profiled(Path(os.environ.get("PROFILE_DIR", "/tmp/hop-profile"))) as profiles:
        time.sleep(seconds)
    print(report(profiles, 1, 1))
