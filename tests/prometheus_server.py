"""A real Prometheus (Debian's package) for a test module, configured by the
shipped dashboards/prometheus.yml: it finds Ray's metrics endpoints through the
service-discovery file Ray's dashboard writes. Only the scrape interval is made
short, so a test does not wait minutes for data."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from http_checks import serving_process
from ports import free_port

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus.yml"
# Where Ray's dashboard lists every node's metrics endpoint (the shipped config reads it).
[SERVICE_DISCOVERY_FILE] = yaml.safe_load(SHIPPED_CONFIG.read_text())["scrape_configs"][0]["file_sd_configs"][0][
    "files"
]


class PrometheusError(AssertionError):
    pass


class Prometheus:
    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def _get(self, path: str, **params) -> object:
        reply = self.http.get(path, params=params).json()
        if reply.get("status") != "success":
            raise PrometheusError(f"{reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def targets_up(self) -> int:
        return sum(1 for target in self._get("/api/v1/targets")["activeTargets"] if target["health"] == "up")

    def wait_until(self, expr: str, check, timeout_s: float = 120) -> float:
        """Poll an instant query until ``check(value)`` holds; return the value."""
        deadline = time.monotonic() + timeout_s
        value = math.nan
        while True:
            result = self.query(expr)
            value = float(result[0]["value"][1]) if result else math.nan
            if result and check(value):
                return value
            if time.monotonic() > deadline:
                targets = [
                    (t["scrapeUrl"], t["health"], t.get("lastError"), t.get("lastScrapeDuration"))
                    for t in self._get("/api/v1/targets")["activeTargets"]
                ]
                raise AssertionError(f"{expr}: {value} after {timeout_s:.0f}s; targets: {targets}")
            time.sleep(1)


def has_values(result: list[dict]) -> bool:
    """A query_range result with at least one number (not NaN)."""
    return any(not math.isnan(float(value)) for series in result for _, value in series["values"])


@contextlib.contextmanager
def running_prometheus(scrape_interval: str = "2s"):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make test installs Debian's package)"
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = scrape_interval
    workdir = Path(tempfile.mkdtemp(prefix="prometheus-test-"))
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        binary,
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        with (
            (workdir / "prometheus.log").open("w") as log,
            serving_process(command, url + "/-/ready", timeout_s=30, stdout=log, stderr=subprocess.STDOUT),
        ):
            yield Prometheus(url)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
