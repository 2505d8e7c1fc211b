"""What the Python interpreter costs this project: CPU seconds of importing vLLM's
OpenAI server (what every model replica and EngineCore process pays when it starts)
and of a loop of the gateway's kind of pure-Python work (json, lists, strings), per
interpreter, medians of repeats, run interleaved (docs/performance.md, "The
interpreter").

    .venv/bin/python bench/interpreter.py --pythons /tmp/other-venv/bin/python .venv/bin/python

Each interpreter must see the project's packages (a virtualenv made by
scripts/setup.sh)."""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

IMPORT = "import vllm.entrypoints.openai.api_server"
LOOP = """
import json, time
start = time.process_time()
body = {"a": [1, 2, 3], "b": "x" * 50, "c": {"d": 1.5}}
for i in range(200_000):
    text = json.dumps(body)
    json.loads(text)
    squares = [j * j for j in range(20)]
    f"{i}:{text[:10]}".split(":")
print(time.process_time() - start)
"""


def child_cpu_s(python: str, code: str) -> float:
    """User + system CPU seconds of one child running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def loop_cpu_s(python: str) -> float:
    done = subprocess.run([python, "-c", LOOP], check=True, capture_output=True, text=True)
    return float(done.stdout.strip())


def describe(python: str) -> str:
    code = "import platform, sys; print(platform.python_version(), sys._base_executable)"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pythons", nargs="+", default=[sys.executable])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    imports: dict[str, list[float]] = {python: [] for python in args.pythons}
    loops: dict[str, list[float]] = {python: [] for python in args.pythons}
    for _ in range(args.repeats):  # interleaved: the box's noise falls on every interpreter alike
        for python in args.pythons:
            imports[python].append(child_cpu_s(python, IMPORT))
            loops[python].append(loop_cpu_s(python))
    print("\n| interpreter | vLLM import CPU s (median; repeats) | loop CPU s (median; repeats) |")
    print("|---|---|---|")
    for python in args.pythons:
        each_import = " / ".join(f"{v:.1f}" for v in imports[python])
        each_loop = " / ".join(f"{v:.2f}" for v in loops[python])
        print(
            f"| {describe(python)} | {statistics.median(imports[python]):.1f} ({each_import}) "
            f"| {statistics.median(loops[python]):.2f} ({each_loop}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
