"""Pure logic: what keeps a replica's leases renewed while its other upkeep is slow.

The soak's run 11 (docs/operating.md) saw five streams of a saturated direct-route
replica reaped `abandoned` with no renewal failing: renewals shared one loop with
shipping a backlog of records (one XADD awaited after another) and reading Serve's
replica count. Renewals run in a loop of their own now, and a batch of records is
handed to the sink in one pipeline turn."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from serve_app.admission.gatekeeper import Gatekeeper
from serve_app.admission.maintenance import IngressReplicas, Maintenance
from serve_app.admission.scripts import Settlement


class StuckUpkeep:
    """A gate whose every upkeep step but renewal never returns (Redis answering a
    starved loop, a backlog that takes minutes); it counts renewal rounds."""

    def __init__(self):
        self.renewals = 0
        self.loop_lag = SimpleNamespace(start=lambda: None)

    async def renew_leases(self) -> bool:
        self.renewals += 1
        return True

    async def _forever(self) -> int:
        await asyncio.Event().wait()
        return 0

    flush_unsettled = reap_abandoned = _forever


async def test_leases_are_renewed_every_third_of_a_lease_while_the_other_upkeep_hangs():
    gate = StuckUpkeep()
    maintenance = Maintenance(gate, None, None, IngressReplicas({}), None, lease_s=0.3, key_cache_ttl_s=1)
    maintenance.start()
    try:
        await asyncio.sleep(0.75)  # seven renewal periods of 0.1 s
    finally:
        for task in (maintenance._task, maintenance._renewals):
            task.cancel()
    assert gate.renewals >= 3, gate.renewals  # one loop for both: 1 (then stuck behind the flush)


class CountingSink:
    """A record shipper whose XADDs wait for each other: how many are out at once."""

    def __init__(self):
        self.out = self.most = 0
        self.shipped: list[dict] = []

    async def ship(self, record: dict) -> None:
        self.out += 1
        self.most = max(self.most, self.out)
        await asyncio.sleep(0.01)
        self.out -= 1
        self.shipped.append(record)


async def test_a_backlog_of_settlements_ships_its_records_at_once():
    gate = Gatekeeper.__new__(Gatekeeper)
    backlog = {f"k/r{n}": Settlement(SimpleNamespace(id="k"), f"r{n}", "completed", 1, 1, "", "m") for n in range(500)}

    async def settle_many(batch):
        return [(True, SimpleNamespace(record={"id": request_id})) for _, request_id, *_ in batch]

    gate._unsettled = dict(backlog)
    gate.admission = SimpleNamespace(settle_many=settle_many)
    gate.records = CountingSink()
    assert await gate.flush_unsettled() == 500
    assert not gate._unsettled
    assert gate.records.most == 500  # all out in one turn; one after another: 1
    assert sorted(r["id"] for r in gate.records.shipped) == sorted(f"r{n}" for n in range(500))
