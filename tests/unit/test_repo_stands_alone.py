"""The repository stands alone: the tests and benchmarks read nothing outside it."""

from __future__ import annotations

import re
from pathlib import Path

from openai_spec import SPEC_PATH

ROOT = Path(__file__).resolve().parents[2]
# A path that climbs out of the repository to the sibling folder the spec once came from.
OUTSIDE = re.compile(r"\.\./shared|\"shared\" / \"openai\"")


def test_the_openai_spec_is_vendored():
    assert SPEC_PATH.is_file()
    assert ROOT in SPEC_PATH.resolve().parents


def test_no_test_or_benchmark_reads_outside_the_repository():
    offenders = []
    for folder in ("tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
