"""Mechanical hygiene, run with the suite (``make test``): ruff's lint and format, the type
checker, and every repository path the code and docs cite, over the product and the soak
that judges it (soak/). Their settings are in pyproject.toml ([tool.ruff], [tool.mypy]:
strict on contract/ and serve_app/wire/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON_PATHS = [
    "serve_app",
    "replicas",
    "autoscale",
    "contract",
    "cluster",
    "soak",
    "tests",
    "bench",
    "scripts",
    "dashboards",
]
# A path of this repository named in a comment, a docstring or a doc: it must exist.
CITED = re.compile(
    r"(?<![\w/.-])((?:serve_app|replicas|autoscale|contract|cluster|soak|tests|bench|scripts|dashboards|docs"
    r"|configs|docker)/[\w./-]*\.(?:py|md|lua|yaml|yml|json|sh|toml))\b"
)


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    checked = run("ruff", "check", "--no-cache", *PYTHON_PATHS)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_code_is_formatted_as_ruff_formats_it():
    checked = run("ruff", "format", "--check", "--no-cache", *PYTHON_PATHS)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_types_check():
    checked = run("mypy")  # what it checks, and how strictly: pyproject.toml [tool.mypy]
    assert checked.returncode == 0, checked.stdout + checked.stderr


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".py", ".md", ".lua", ".yaml", ".yml", ".sh", ".toml"}
    return [
        ROOT / name
        for name in names
        if not name.startswith(("spec/", "third_party/")) and (Path(name).suffix in suffixes or name == "Makefile")
    ]


def test_every_path_the_code_and_docs_cite_exists():
    missing = {}
    for path in tracked_text_files():
        if not path.exists():
            continue
        for match in CITED.finditer(path.read_text(errors="replace")):
            cited = match.group(1).rstrip(".")
            if not (ROOT / cited).exists() and not (path.parent / cited).exists():  # or beside the file
                missing.setdefault(cited, []).append(str(path.relative_to(ROOT)))
    assert not missing, missing
