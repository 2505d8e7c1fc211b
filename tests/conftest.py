import sys
from pathlib import Path

# Test helpers (stack.py, openai_spec.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- where the suite's time goes, per module --------------------------------------------

_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # setup + call + teardown, so a module's (or package's) stack start and stop count.
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_MODULE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", "slowest modules (setup + tests + teardown)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
