"""The loop each ingress (and direct-route) replica runs beside its requests: renew the
concurrency leases of the requests it runs, retry the settlements Redis missed, stop
the requests of a key or team revoked since they were admitted, and keep the count of
replicas that share a key's limits while Redis is down."""

from __future__ import annotations

import asyncio
import logging
import time

from serve_app.accounting.record_shipper import RecordShipper
from serve_app.admission.gatekeeper import Gatekeeper
from serve_app.admission.seam import Ticket
from serve_app.identity.jwt_auth import is_jwt_identity
from serve_app.identity.keys import KeyStore
from serve_app.identity.teams import TeamNotFound, TeamStore, is_team_id
from serve_app.redis_store.redis_client import REDIS_FAILED

logger = logging.getLogger("ray.serve")

MAINTENANCE_TICK_S = 1.0
REPLICA_COUNT_REFRESH_S = 10.0


class IngressReplicas:
    """How many ingress replicas share a key's limits while Redis is down: the
    configured count, or for an autoscaled ingress the running count Serve
    reports (refreshed every ``REPLICA_COUNT_REFRESH_S``; until known, the
    autoscaler's maximum, which errs on the strict side)."""

    def __init__(self, deployment: dict):
        autoscaling = deployment.get("autoscaling_config")
        replicas = deployment.get("num_replicas", 1)
        self.autoscaled = bool(autoscaling) or not isinstance(replicas, int)
        if self.autoscaled:
            maximum = (autoscaling or {}).get("max_replicas") if isinstance(autoscaling, dict) else None
            self._count = int(maximum or 100)  # Serve's default max for num_replicas "auto"
        else:
            self._count = max(replicas, 1)

    def count(self) -> int:
        return self._count

    async def refresh(self) -> None:
        try:
            running = await asyncio.to_thread(_running_replicas_of_this_deployment)
        except Exception:  # the controller is busy or away: keep the last count
            logger.warning("could not read the ingress replica count from Serve", exc_info=True)
            return
        if running:
            self._count = running


def _running_replicas_of_this_deployment() -> int:
    from ray import serve

    context = serve.get_replica_context()
    status = serve.status().applications[context.app_name].deployments[context.deployment]
    return sum(count for state, count in status.replica_states.items() if state == "RUNNING")


class Maintenance:
    def __init__(
        self,
        gate: Gatekeeper,
        keys: KeyStore,
        teams: TeamStore,
        replicas: IngressReplicas,
        records: RecordShipper | None,
        lease_s: float,
        key_cache_ttl_s: float,
    ):
        self.gate, self.keys, self.teams, self.replicas, self.records = gate, keys, teams, replicas, records
        self.renew_every_s = lease_s / 3
        # Both loops tick at least every third of a lease: with a short lease the reaper
        # and the retried settlements keep its pace too.
        self.tick_s = min(MAINTENANCE_TICK_S, self.renew_every_s)
        # How often the keys of running requests are read again (a revoked key's streams stop).
        self.revocation_check_s = max(key_cache_ttl_s, MAINTENANCE_TICK_S)
        self._task: asyncio.Task | None = None
        self._renewals: asyncio.Task | None = None

    def start(self) -> None:
        """Start the loops on the running event loop (Serve runs ``__init__`` on it)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.maintain())
            self._renewals = asyncio.get_running_loop().create_task(self.renew_forever())
            self.gate.loop_lag.start()
            if self.records is not None:
                self.records.start()

    async def renew_forever(self) -> None:
        """Renew the leases of the requests this replica runs every third of a lease,
        and again at the next tick, not a third of a lease later, when Redis did not
        take them. A loop of its own: the one step whose delay loses something (a lease
        that runs out while its request runs is reaped `abandoned`, its reservation
        charged), so no other step can hold it up. In the soak's run 11 five streams
        of a saturated replica got no renewal for a whole lease, with no renewal
        failing, while the one loop shipped a backlog of settlements' records and read
        Serve's replica count."""
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            try:
                if now - last_renewal >= self.renew_every_s and await self.gate.renew_leases():
                    last_renewal = now
            except Exception:  # never let one bad round end the loop
                logger.exception("lease renewal failed")

    async def maintain(self) -> None:
        if self.replicas.autoscaled:
            await self.replicas.refresh()
        last_count = last_check = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            try:
                await self.gate.flush_unsettled()
                await self.gate.reap_abandoned()
                if now - last_check >= self.revocation_check_s:
                    last_check = now
                    await self.stop_revoked()
                if self.replicas.autoscaled and now - last_count >= REPLICA_COUNT_REFRESH_S:
                    last_count = now
                    await self.replicas.refresh()
            except Exception:  # never let one bad tick end the loop
                logger.exception("quota maintenance tick failed")

    async def stop_revoked(self) -> int:
        """Read the keys of the requests running here again and mark those of a key
        now revoked or disabled (a stream's relay ends it at its next item, charged
        what it delivered; a unary call is cancelled through ``on_revoke``).
        Returns how many were marked."""
        running: dict[str, list[Ticket]] = {}
        for ticket in self.gate.running_tickets():
            if ticket.revoked:
                continue
            # A JWT user is not in the key store (its token's expiry is its revocation):
            # only its team is read again.
            if not is_jwt_identity(ticket.key.id):
                running.setdefault(ticket.key.id, []).append(ticket)
            elif ticket.team is not None:
                running.setdefault(ticket.team.id, []).append(ticket)
        # Read at once, in one turn's pipeline: read one after another, a saturated
        # replica's loop takes a turn per account (its every reply waits for the loop),
        # and a revoked key's stream ran on 49.7 s in the soak's run 12.
        verdicts = await asyncio.gather(*(self._gone(account_id) for account_id in running))
        marked = 0
        for tickets, gone in zip(running.values(), verdicts, strict=True):
            if gone:
                for ticket in tickets:
                    ticket.revoked = True
                    if ticket.on_revoke is not None:
                        ticket.on_revoke()
                marked += len(tickets)
        return marked

    async def _gone(self, account_id: str) -> bool:
        """Whether a key or team is revoked or disabled now (False while Redis cannot
        say: the next check reads it again)."""
        try:
            if is_team_id(account_id):
                return not (await self.teams.get(account_id)).enabled
            return await self.keys.active(account_id) is None
        except TeamNotFound:
            return True
        except REDIS_FAILED:
            return False
