"""tests/skip_policy.py: a skip for a reason not on its list fails the session, naming
the test and the reason; an allowed one is shown and passes (inner pytest sessions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import skip_policy

pytest_plugins = ["pytester"]

TESTS = str(Path(__file__).resolve().parents[1])  # where skip_policy imports from


@pytest.fixture
def inner(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.delenv(skip_policy.FILE_ENV, raising=False)

    def run(source: str, *args: str):
        pytester.makepyfile(test_inner=source)
        return pytester.runpytest_subprocess("-p", "skip_policy", "-p", "no:randomly", "-p", "no:cacheprovider", *args)

    return run


def test_an_undocumented_skip_fails_the_run_naming_the_test_and_its_reason(inner):
    result = inner(
        """
import pytest

def test_runs():
    pass

def test_quietly_skipped():
    pytest.skip("the moon is full")
"""
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*skips: 1, 1 of them not allowed*", "NOT ALLOWED test_inner.py::test_quietly_skipped: the moon is full"]
    )
    result.assert_outcomes(passed=1, skipped=1)


def test_an_allowed_skip_is_shown_and_passes(inner):
    result = inner(
        """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs an x86-64 Linux CPU with AMX")
def test_amx():
    pass
"""
    )
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        ["*skips: 1, 0 of them not allowed*", "allowed *test_amx: needs an x86-64 Linux CPU with AMX (*"]
    )


def test_a_module_skipped_at_collection_counts_and_xfail_does_not(inner):
    result = inner(
        """
import pytest

pytest.skip("not today", allow_module_level=True)
"""
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["NOT ALLOWED test_inner.py: not today"])

    xfailed = inner(
        """
import pytest

@pytest.mark.xfail(reason="known")
def test_known():
    assert False
"""
    )
    assert xfailed.ret == pytest.ExitCode.OK
    assert "skips:" not in xfailed.stdout.str()


def test_a_lane_process_writes_its_skips_and_the_session_counts_them(inner, pytester, monkeypatch, tmp_path):
    """What tests/waiting_lane.py does with its second process: the lane writes, this reads."""
    written = tmp_path / "skips"
    monkeypatch.setenv(skip_policy.FILE_ENV, str(written))
    inner("import pytest\n\ndef test_lane_skip():\n    pytest.skip('mounting a tmpfs needs root')\n")
    [line] = written.read_text().splitlines()
    assert json.loads(line)["nodeid"] == "test_inner.py::test_lane_skip"

    policy = skip_policy.SkipPolicy(pytester.parseconfig())
    policy.take_file(written)
    assert [skip.allowed_because for skip in policy.skips] == [skip_policy.ALLOWED["mounting a tmpfs needs root"]]
    assert policy.undocumented() == []


def test_every_allowed_reason_is_one_the_suite_gives_and_the_docs_list():
    root = Path(TESTS).parent
    here = Path(__file__).resolve()
    policy = root / "tests" / "skip_policy.py"
    sources = "\n".join(path.read_text() for path in (root / "tests").rglob("*.py") if path not in (here, policy))
    docs = (root / "docs" / "test-time.md").read_text()
    for pattern in skip_policy.ALLOWED:
        assert pattern in sources, f"no test skips for {pattern!r}: take it off the list"
        assert pattern in docs, f"{pattern!r} is not in docs/test-time.md's list"
