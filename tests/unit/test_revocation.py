"""Pure logic: which running requests ``Maintenance.stop_revoked`` marks and tells (the e2e tests
in tests/e2e/quota_stack/test_1_hostile_tenant_e2e.py revoke a key mid-request on
the real stack, a stream and a unary call)."""

from redis.exceptions import ConnectionError as RedisConnectionError

from serve_app.admission.maintenance import IngressReplicas, Maintenance
from serve_app.admission.seam import Ticket
from serve_app.identity.keys import KeyNotFound, KeyRecord, KeyStore


class Running:
    """The gate's side maintenance reads: the requests running here."""

    def __init__(self, tickets: list[Ticket]):
        self.tickets = tickets

    def running_tickets(self) -> list[Ticket]:
        return list(self.tickets)


def access_running(records: dict[str, object], tickets: list[Ticket]) -> Maintenance:
    """Maintenance whose key store answers ``records`` (a KeyRecord, or an exception to raise)."""

    async def get(key_id):
        found = records[key_id]
        if isinstance(found, Exception):
            raise found
        return found

    keys = KeyStore.__new__(KeyStore)  # its own `active`, over this `get`
    keys.get = get
    return Maintenance(Running(tickets), keys, None, IngressReplicas({}), None, lease_s=30, key_cache_ttl_s=1)


def ticket(key_id: str, n: int) -> Ticket:
    return Ticket(KeyRecord(id=key_id, name=key_id, created_at=0), f"{key_id}-{n}", "m")


async def test_the_requests_of_a_revoked_or_disabled_key_are_marked_and_no_others():
    running = [ticket("kok", 1), ticket("kgone", 1), ticket("kgone", 2), ticket("koff", 1)]
    access = access_running(
        {
            "kok": KeyRecord(id="kok", name="ok", created_at=0),
            "kgone": KeyNotFound("kgone"),
            "koff": KeyRecord(id="koff", name="off", created_at=0, enabled=False),
        },
        running,
    )
    assert await access.stop_revoked() == 3
    assert [t.revoked for t in running] == [False, True, True, True]
    assert await access.stop_revoked() == 0  # marked once


async def test_redis_unreachable_marks_nothing():
    running = [ticket("k1", 1)]
    access = access_running({"k1": RedisConnectionError("down")}, running)
    assert await access.stop_revoked() == 0 and not running[0].revoked


async def test_a_marked_request_is_told_once_so_a_unary_call_cancels_itself():
    cancelled = []
    gone, kept = ticket("kgone", 1), ticket("kok", 1)
    gone.on_revoke = lambda: cancelled.append("kgone")
    kept.on_revoke = lambda: cancelled.append("kok")
    access = access_running(
        {"kok": KeyRecord(id="kok", name="ok", created_at=0), "kgone": KeyNotFound("kgone")}, [gone, kept]
    )
    await access.stop_revoked()
    await access.stop_revoked()
    assert cancelled == ["kgone"]


async def test_the_keys_of_running_requests_are_read_at_once():
    """One turn's pipeline for all of them: a saturated replica's loop takes a turn per
    read, so reads one after another stopped a revoked key's stream late (soak run 12)."""
    import asyncio

    keys = [f"k{n}" for n in range(50)]
    in_flight: set[str] = set()
    all_out = asyncio.Event()

    async def get(key_id):
        in_flight.add(key_id)
        if len(in_flight) == len(keys):
            all_out.set()
        await all_out.wait()  # answered only once every read is out: one after another never gets here
        return KeyNotFound(key_id) if key_id == "k7" else KeyRecord(id=key_id, name=key_id, created_at=0)

    async def raising_get(key_id):
        found = await get(key_id)
        if isinstance(found, Exception):
            raise found
        return found

    running = [ticket(key_id, 1) for key_id in keys]
    access = access_running({}, running)
    access.keys.get = raising_get
    assert await asyncio.wait_for(access.stop_revoked(), 2) == 1
    assert [t.key.id for t in running if t.revoked] == ["k7"]


async def test_a_key_redis_cannot_read_leaves_the_others_checked():
    running = [ticket("kdown", 1), ticket("kgone", 1)]
    access = access_running({"kdown": RedisConnectionError("down"), "kgone": KeyNotFound("kgone")}, running)
    assert await access.stop_revoked() == 1 and [t.revoked for t in running] == [False, True]
