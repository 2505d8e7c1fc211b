import os
import sys
from pathlib import Path

# Test helpers (stack.py, openai_spec.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import skip_policy  # noqa: E402  (found through the path just set)
import waiting_lane  # noqa: E402

# Every process a test stack starts inherits this environment: the OpenTelemetry SDK's
# batch span processors (the gateway's and vLLM's) export every 0.5 s instead of 5 s,
# so a test waits half a second, not five, for a trace to arrive or to be sure none will.
os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")


def pytest_configure(config):
    config.pluginmanager.register(waiting_lane, "waiting_lane")
    config.pluginmanager.register(skip_policy, "skip_policy")  # a skip not on its list fails the run


# -- where the suite's time goes, per module --------------------------------------------

_MODULE_SECONDS: dict[str, float] = {}
# The machine's busy and total CPU time (jiffies, all cores) while each module ran:
# a module that keeps the cores busy is slow because of work (stack starts, engines),
# one that leaves them idle is slow because of waits (leases, windows, timeouts).
_MODULE_CPU: dict[str, list[int]] = {}
_CURRENT: list = [None, (0, 0)]


def _machine_cpu() -> tuple[int, int]:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _close_module() -> None:
    module, (busy0, total0) = _CURRENT
    if module is not None:
        busy, total = _machine_cpu()
        spent = _MODULE_CPU.setdefault(module, [0, 0])
        spent[0] += busy - busy0
        spent[1] += total - total0


def pytest_runtest_logstart(nodeid, location):
    module = nodeid.split("::", 1)[0]
    if module != _CURRENT[0]:
        _close_module()
        _CURRENT[:] = [module, _machine_cpu()]


def pytest_runtest_logreport(report):
    # setup + call + teardown, so a module's (or package's) stack start and stop count.
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_MODULE_SECONDS) < 2:
        return
    _close_module()
    _CURRENT[0] = None
    terminalreporter.write_sep("=", "slowest modules (setup + tests + teardown; the cores' busy share meanwhile)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])[:25]:
        busy, total = _MODULE_CPU.get(module, (0, 0))
        share = f"{100 * busy / total:4.0f}%" if total else "    "
        terminalreporter.write_line(f"{seconds:8.1f}s {share}  {module}")
