"""The soak's short variant (soak/, `make soak` runs the long one): the same harness
and the same ledger, for 100 s of load. The gateway on the `ray up`
twin with 8 ingress replicas and a direct route, a Redis Cluster of 3 primaries and
3 replicas behind chaos proxies, 2,000 keys in 50 teams under Zipf traffic of mixed
shapes (one model on real vLLM), every fault kind once, limits lowered and keys and
a team revoked mid-run; then the ledger's verdict from Redis, the record sink and
what every client saw (soak/ledger.py)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from stack import ray_processes, wait_for_no_engines

from soak.harness import Shape, soak

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_ledger_holds_under_load_and_every_fault_kind():
    deadline = time.monotonic() + 30  # the previous module's Ray may still be going away
    while ray_processes():
        assert time.monotonic() < deadline, f"another Ray instance runs here; `ray up` would stop it: {ray_processes()}"
        time.sleep(0.5)
    verdict = asyncio.run(soak(Shape(duration_s=100, seed=11, clients=40, lease_s=15, batch_end_s=60)))
    wait_for_no_engines()
    assert not ray_processes()
    assert verdict.counts["admitted (client saw 200)"] > 500
    assert verdict.counts["charges matched to the token"] > 300
    assert verdict.passed, "\n".join(f"{v.check} {v.subject}: {v.detail}" for v in verdict.violations[:20])
    shutil.rmtree(verdict.run_folder)  # kept to look into when the ledger fails
