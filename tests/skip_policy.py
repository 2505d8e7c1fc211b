"""Nothing is skipped unseen (docs/test-time.md, "Allowed skips").

Every skip of a session (a test's, or a module's at collection) is listed in the
terminal summary with its reason. A skip whose reason matches none of ``ALLOWED``
fails the session (exit 1), named with its test and reason: a test that stops running
must be noticed, not scroll past as an ``s``. xfail is not a skip and is not counted.

The integration tests' lane (tests/waiting_lane.py) is a second pytest process: it
runs this plugin too (its own undocumented skip fails it, and so this session), and it
writes its skips to the file ``LLM_TEST_SKIPS_FILE`` names, which this session reads
back (``take_file``) so that its summary lists both processes' skips. An xdist worker
only reports: its controller counts."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

# A skip's reason (a regular expression, searched) -> why it may happen. Only what a
# machine may lack that the suite cannot provide; a missing package or tool that
# `make test` installs is not on the list: its skip is a failure.
ALLOWED: dict[str, str] = {
    r"needs an x86-64 Linux CPU with AMX": (
        "hardware: the AMX permission request (replicas/cpu_amx.py) can only be seen on a CPU with AMX; "
        "the CI machine (an AMD EPYC) has none"
    ),
    r"no CAP_SYS_NICE": (
        "privilege: a container or user without CAP_SYS_NICE cannot use the real-time class, "
        "and scripts/ensure_redis.sh then starts Redis without it"
    ),
    r"mounting a tmpfs needs root": (
        "privilege: the full-disk tests mount a small tmpfs (tests/small_disk.py), which needs root"
    ),
    r"kubectl is not installed: the Python kustomize build is compared with kubectl's where it is": (
        "a tool the suite does not need: the manifests are built (cluster/kustomize.py) and validated "
        "without it; only the comparison of that build with `kubectl kustomize` needs kubectl"
    ),
    r"py-spy comes with the bench extra": (
        "a tool `make test` does not install: py-spy comes with the bench extra (`make bench`), "
        "scripts/setup.sh installs only [cpu,test]"
    ),
}

FILE_ENV = "LLM_TEST_SKIPS_FILE"  # where a lane process writes its skips (JSON lines)
DOC = "docs/test-time.md, “Allowed skips”"


@dataclass
class Skip:
    nodeid: str
    reason: str
    allowed_because: str | None  # None: not on the list


def why_allowed(reason: str) -> str | None:
    for pattern, why in ALLOWED.items():
        if re.search(pattern, reason):
            return why
    return None


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipPolicy:
    """One session's skips (registered by ``pytest_configure``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skips: list[Skip] = []
        # Read once and kept from the tests' own subprocesses: only this process writes there.
        self.target = os.environ.pop(FILE_ENV, None)

    def record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            self.skips.append(Skip(report.nodeid, reason, why_allowed(reason)))

    def take_file(self, path: Path) -> None:
        """Another process's skips (the lane's), counted as this session's."""
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return
        self.skips += [Skip(**json.loads(line)) for line in lines if line.strip()]

    def undocumented(self) -> list[Skip]:
        return [skip for skip in self.skips if skip.allowed_because is None]

    def pytest_runtest_logreport(self, report) -> None:
        self.record(report)

    def pytest_collectreport(self, report) -> None:
        self.record(report)  # a module skipped as a whole (pytest.skip(allow_module_level=True))

    @pytest.hookimpl(trylast=True)  # after tests/waiting_lane.py handed over the lane's skips
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.target:
            with open(self.target, "a") as out:
                out.writelines(json.dumps(asdict(skip)) + "\n" for skip in self.skips)
        if self.undocumented() and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        bad = self.undocumented()
        terminalreporter.write_sep("=", f"skips: {len(self.skips)}, {len(bad)} of them not allowed ({DOC})")
        for skip in self.skips:
            if skip.allowed_because is None:
                terminalreporter.write_line(f"NOT ALLOWED {skip.nodeid}: {skip.reason}", red=True, bold=True)
            else:
                terminalreporter.write_line(f"allowed     {skip.nodeid}: {skip.reason} ({skip.allowed_because})")
        if bad:
            terminalreporter.write_line(
                "a skip for a reason not in tests/skip_policy.py's ALLOWED fails the run: make the test run, "
                f"or add its reason there and to {DOC}, with why it may skip",
                red=True,
            )


PLUGIN = "skip_policy_session"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # an xdist worker only reports: its controller counts
        config.pluginmanager.register(SkipPolicy(config), PLUGIN)


def policy(config: pytest.Config) -> SkipPolicy | None:
    return config.pluginmanager.get_plugin(PLUGIN)
