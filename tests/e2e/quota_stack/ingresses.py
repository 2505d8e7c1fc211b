"""Which ingress replica served a request, read from the access logs of this
package's stack (two ingress replicas)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

SESSION_LOGS = Path("/tmp/ray/session_latest/logs")


def ingress_pid(request_id: str) -> int:
    """The process of the ingress replica whose access log has ``request_id``."""
    for path in SESSION_LOGS.glob("worker-*.out"):
        if f'"request_id":"{request_id}"' in path.read_text(errors="replace"):
            return int(re.search(r"-(\d+)\.out$", path.name)[1])
    raise AssertionError(f"no access line for {request_id}")


def wait_until_both_ingresses_serve(base_url: str, secret: str, model: str, timeout_s: float = 180) -> None:
    """After an ingress replica was killed: until requests on new connections are
    served by two different live ingress processes again (Serve restarted the
    replica and HAProxy routes to it), so the next module finds the stack as it was.
    Asked by a route only the ingress serves (/v1 chat takes its model's direct route)."""
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    body = {"model": model, "input": "hi", "max_output_tokens": 1, "store": False}
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only ingress processes {seen} served"
        try:
            response = httpx.post(
                base_url + "/v1/responses", json=body, timeout=30, headers={"authorization": f"Bearer {secret}"}
            )
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if response.status_code == 200:
            time.sleep(0.2)  # the access line is written as the request ends
            try:
                seen.add(ingress_pid(response.headers["x-request-id"]))
            except AssertionError:
                pass
        else:
            time.sleep(0.5)
