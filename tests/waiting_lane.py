"""The integration tests wait far more than they compute (Redis failovers, lease
expiries, rate windows: 10-30 % of the cores busy while they run alone), and the
unit tests compute without waiting. When one session selects both, the
integration tests run in a second pytest process beside the unit tests (pytest runs
them after the end-to-end tests: the lane starts with the first test outside
tests/e2e, and an end-to-end test waits for a lane that runs). A stack starting
beside the lane took up to twice as long: the `ray up` twin's start went from 109 to
208 s in a CI run where the lane overlapped it. The lane's failures fail this
session, its report printed in this one's summary; so do its skips for a reason not
allowed (tests/skip_policy.py), and this session's summary lists the lane's skips.

The lane runs its modules on two pytest-xdist workers (``--dist loadfile``: a module
stays on one worker, the next goes to whichever is free): they wait far more than
they compute, so two of them beside the unit tests take about half the time of one
(409 tests: 2:15 alone on two workers; 4:21 on one beside the unit tests, a CI run).

A module marked ``machine_wide`` stays in this process: it starts or ends
something the end-to-end tests count or end on the whole machine (HAProxy: every
stack's teardown ends any that is left).

``LLM_TEST_LANE=0`` runs everything in one process; the lane itself runs with
``LLM_TEST_LANE=lane`` and never splits again."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import skip_policy

LANE_ENV = "LLM_TEST_LANE"
LANE_DIR = "tests/integration/"
LANE_WAIT_S = 30 * 60  # the lane alone takes ~3 min here; past this it is stuck
LANE_WORKERS = ["-n", "2", "--dist", "loadfile"]


class WaitingLane:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.output: Path | None = None
        self.skips: Path | None = None
        self.count = 0

    def start(self, config: pytest.Config, nodeids: list[str]) -> None:
        folder = Path(tempfile.mkdtemp(prefix="waiting-lane-"))
        args = folder / "args"
        args.write_text("\n".join(nodeids) + "\n")
        self.output = folder / "output"
        self.skips = folder / "skips"  # the lane's skips (tests/skip_policy.py), one JSON a line
        self.count = len(nodeids)
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", f"@{args}", "-q", "-rfEs", "-p", "no:cacheprovider", *LANE_WORKERS],
                cwd=config.rootpath,
                env={**os.environ, LANE_ENV: "lane", skip_policy.FILE_ENV: str(self.skips)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of this session reaches it through stop()
            )

    def wait(self) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=LANE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            return -1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def report(self, rc: int) -> str:
        assert self.output is not None
        text = self.output.read_text(errors="replace")
        if rc != 0:
            return text  # the whole report: its failures, tracebacks and output
        return "\n".join(text.rstrip().splitlines()[-30:])  # its slowest modules and its count


_LANE = WaitingLane()


def _in_lane(item: pytest.Item, rootpath: Path) -> bool:
    path = Path(str(item.path)).resolve().relative_to(rootpath).as_posix()
    return path.startswith(LANE_DIR) and item.get_closest_marker("machine_wide") is None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the lane runs only what was selected
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(LANE_ENV) in ("lane", "0") or config.option.collectonly:
        return
    rootpath = config.rootpath.resolve()
    lane = [item.nodeid for item in items if _in_lane(item, rootpath)]
    if not lane or len(lane) == len(items):
        return  # nothing to run beside
    items[:] = [item for item in items if not _in_lane(item, rootpath)]
    config.stash[_PENDING] = lane


_PENDING = pytest.StashKey[list[str]]()  # the lane's tests, until it starts
_RC = pytest.StashKey[int]()


def _start_lane(config: pytest.Config) -> None:
    lane = config.stash.get(_PENDING, None)
    if lane and _LANE.proc is None:
        _LANE.start(config, lane)


def _await_lane(config: pytest.Config) -> None:
    if _LANE.proc is not None and _RC not in config.stash:
        config.stash[_RC] = _LANE.wait()
        policy = skip_policy.policy(config)
        if policy is not None and _LANE.skips is not None:
            policy.take_file(_LANE.skips)


def _is_e2e(item: pytest.Item) -> bool:
    return "/tests/e2e/" in Path(str(item.path)).as_posix()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Beside the first test that starts no stack (pytest's order: e2e, then unit), and
    # never beside a stack: an e2e test waits for a lane that runs.
    if _is_e2e(item):
        _await_lane(item.config)
    else:
        _start_lane(item.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.exitstatus == pytest.ExitCode.INTERRUPTED:
        _LANE.stop()
    elif _LANE.proc is None:
        _start_lane(session.config)  # nothing else ran beside it: it runs now
    if _LANE.proc is None:
        return
    _await_lane(session.config)
    if session.config.stash[_RC] != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    rc = config.stash.get(_RC, None)
    if rc is None:
        return
    verdict = "passed" if rc == 0 else f"FAILED (exit {rc})"
    terminalreporter.write_sep("=", f"waiting lane: {_LANE.count} integration tests run beside, {verdict}")
    terminalreporter.write_line(_LANE.report(rc))


def pytest_unconfigure(config: pytest.Config) -> None:
    _LANE.stop()  # interrupted before its end: the lane goes with it
