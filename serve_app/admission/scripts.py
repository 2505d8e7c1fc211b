"""Admission and accounting of requests against a key's quotas, in Redis.

Five scripts (``lua/``), each loaded once and called by SHA, each touching only
the key's own hash-tagged keys; the calls of one event-loop turn share a round
trip (serve_app/redis_store/auto_pipeline.py). A team is admitted by the same scripts
as a key (its record has a key record's limits: identity/teams.py):

- ``admit``: concurrency lease, requests/min, tokens/min reservation, daily and
  monthly token budgets, and the request record — all decided and written
  atomically, so concurrent requests cannot overshoot a limit.
- ``running``: the first token is out.
- ``settle``: real usage replaces the reservation, the lease is released,
  the record is final (idempotent; also closes the id of a request admitted
  without Redis, so a late admit of it changes nothing).
- ``renew``: an ingress keeps the leases of its running requests alive.
- ``release``: undo an admission that another level of the request refused.

Limits use GCRA over 60 s (see admit.lua): a key with L/min may burst L at
once, then gets one more every 60/L s. Over any span of s seconds it is
admitted at most L + L*s/60.
"""

from __future__ import annotations

import asyncio
import datetime
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from serve_app.accounting.costs import NANOS_PER_USD, Cost
from serve_app.accounting.usage import as_state, is_own_key, key_id_of
from serve_app.admission.seam import Decision, LocalOrigin
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import is_team_id
from serve_app.redis_store import lua_scripts, redis_names
from serve_app.redis_store.auto_pipeline import AutoPipeline


def usd_nanos(usd: float) -> str:
    """A budget in USD as the integer string of nano-dollars the scripts compare."""
    return str(round(usd * NANOS_PER_USD))


# Client-chosen x-request-ids are indexed only when short and plain (Ray Serve
# answers with the client's own id when it sent one): an index key per request
# must not let a client store kilobytes per request.
_INDEXABLE_HTTP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def indexable_http_id(http_request_id: str) -> str:
    """``http_request_id`` if it may be indexed, else ''."""
    return http_request_id if _INDEXABLE_HTTP_ID.fullmatch(http_request_id or "") else ""


class Settlement(NamedTuple):
    """One request's final accounting at one level (key or team): ``settle``'s
    arguments, named, so that a settlement queued while Redis is away
    (Gatekeeper._unsettled) is read back by field, never by position."""

    key: KeyRecord
    request_id: str
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replica: str = ""
    model: str = ""
    cost: Cost = Cost()
    origin: LocalOrigin | None = None
    taken_back: bool = False
    failover: str = ""


class AdmissionScripts:
    def __init__(
        self,
        redis,
        *,
        lease_s: float,
        retention_s: int,
        settled_s: int | None = None,
        replicas_to_acknowledge: int = 0,
        acknowledge_timeout_ms: int = 100,
    ):
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)
        self.retention_s = retention_s
        # With a record sink (record_shipper.py): how long a final record stays in
        # Redis, and settlement hands the record on to the sink; None: no sink, a
        # record stays its whole retention.
        self.settled_s = settled_s
        # Called by EVALSHA, through the auto-pipeline (its module says how a
        # missing script is loaded, and how replicas acknowledge).
        self.pipeline = AutoPipeline(
            redis, replicas_to_acknowledge=replicas_to_acknowledge, acknowledge_timeout_ms=acknowledge_timeout_ms
        )
        self._admit = lua_scripts.register(redis, __package__, "admit")
        self._running = lua_scripts.register(redis, __package__, "running")
        self._settle = lua_scripts.register(redis, __package__, "settle")
        self._renew = lua_scripts.register(redis, __package__, "renew")
        self._release = lua_scripts.register(redis, __package__, "release")
        self._reap = lua_scripts.register(redis, __package__, "reap")
        self._due = lua_scripts.register(redis, __package__, "due")
        self._room = lua_scripts.register(redis, __package__, "room")

    async def admit(
        self,
        key: KeyRecord,
        request_id: str,
        model: str,
        reserve_tokens: int,
        http_request_id: str = "",
        reserve_nanos: int = 0,
        team_id: str = "",
        request_paid: bool = False,
    ) -> Decision:
        """One EVALSHA. ``http_request_id`` is stored in the record when indexable
        (``index_http_id`` writes its lookup key, off the request path);
        ``reserve_nanos``: the request's reserved cost, for the money budgets;
        ``team_id``: the team the key's request is charged to (kept in its record: the
        usage API reports it there, wherever the key moves later); ``request_paid``:
        admitted again once rendered, its requests/min already charged (``release``)."""
        keys = redis_names.admission_keys(key.id, request_id)
        args = [
            request_id,
            model,
            key.requests_per_minute,
            key.tokens_per_minute,
            key.max_concurrent,
            key.daily_token_budget,
            key.monthly_token_budget,
            reserve_tokens,
            self.lease_ms,
            self.retention_s,
            key.id,
            indexable_http_id(http_request_id),
            usd_nanos(key.daily_cost_budget_usd),
            usd_nanos(key.monthly_cost_budget_usd),
            str(int(reserve_nanos)),
            "1" if redis_names.has_stored_limits(key.id) else "0",
            team_id,
            "1" if request_paid else "0",
        ]
        reply = await self.pipeline.call(self._admit, keys, args)
        admitted, kind, retry, rr, rs, kr, ks, detail = reply[:8]
        applied = _text(reply[8]) if len(reply) > 8 else ""
        return Decision(
            bool(admitted), _text(kind), int(retry), int(rr), int(rs), int(kr), int(ks), _text(detail), applied
        )

    async def room(self, key: KeyRecord) -> Decision:
        """Whether one more request of ``key`` passes its requests/min and concurrency
        now, charging nothing (room.lua; a refusal is counted). ``admitted``: it does."""
        reply = await self.pipeline.call(
            self._room,
            redis_names.admission_keys(key.id, ""),
            [
                key.requests_per_minute,
                key.max_concurrent,
                "1" if redis_names.has_stored_limits(key.id) else "0",
                key.tokens_per_minute,
            ],
        )
        room, kind, retry, rr, rs, kr, ks, detail, applied = reply[:9]
        return Decision(
            bool(room), _text(kind), int(retry), int(rr), int(rs), int(kr), int(ks), _text(detail), _text(applied)
        )

    async def release(self, key: KeyRecord, request_id: str, refused_by: str, keep_request: bool = False) -> bool:
        """Undo ``request_id``'s admission at ``key``'s level (another level refused
        it: ``refused_by`` names that level's limit, e.g. ``team_requests``).
        ``keep_request``: its requests/min stays charged (its prompt was rendered)."""
        reply = await self.pipeline.call(
            self._release,
            redis_names.admission_keys(key.id, request_id),
            [request_id, key.requests_per_minute, key.tokens_per_minute, refused_by, "1" if keep_request else ""],
        )
        return bool(reply)

    async def index_http_id(self, http_request_id: str, request_id: str) -> None:
        """Let ``requests show <x-request-id>`` find an admitted request (the index
        lives outside the key's hash tag, so not in the admit script)."""
        if indexable_http_id(http_request_id):
            key_id, _ = key_id_of(request_id)
            # The first request to use an id keeps the global entry (NX): a tenant that
            # reuses another's x-request-id never takes over its lookup; per key, the last.
            kept_s = self.settled_s or self.retention_s  # past it, the record sink answers the lookup
            # Both in the turn's pipeline with the admissions and settlements: no write of their own.
            await asyncio.gather(
                self.pipeline.command("SET", redis_names.http_request(http_request_id), request_id, "EX", kept_s, "NX"),
                self.pipeline.command(
                    "SET", redis_names.http_request(http_request_id, key_id), request_id, "EX", kept_s
                ),
            )

    async def running(self, key_id: str, request_id: str, replica: str = "") -> None:
        await self.pipeline.call(self._running, redis_names.admission_keys(key_id, request_id), [replica])

    async def settle(
        self,
        key: KeyRecord,
        request_id: str,
        status: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        replica: str = "",
        model: str = "",
        cost: Cost = Cost(),
        origin: LocalOrigin | None = None,
        taken_back: bool = False,
        failover: str = "",
    ) -> Settled | None:
        """Final accounting. Idempotent: safe to retry; None when the request was
        settled already. ``origin``: of a request admitted without Redis, for its record.
        ``taken_back``: it takes back an admission still on the wire (its client left),
        so a record it finds missing was never admitted here, not admitted locally.
        ``failover``: what failed over on its way (``Ticket.failover``), for its record."""
        settlement = Settlement(
            key,
            request_id,
            status,
            prompt_tokens,
            completion_tokens,
            replica,
            model,
            cost,
            origin,
            taken_back,
            failover,
        )
        reply = await self.pipeline.call(
            self._settle, redis_names.admission_keys(key.id, request_id), self._settle_args(settlement)
        )
        return _settled(request_id, reply)

    def _settle_args(self, item: Settlement) -> list:
        """settle.lua's ARGV for ``item``."""
        now = datetime.datetime.now(datetime.UTC)
        ship = self.settled_s is not None and is_own_key(item.key.id, item.request_id)
        cost, origin = item.cost, item.origin
        return [
            item.request_id,
            item.status,
            item.prompt_tokens,
            item.completion_tokens,
            item.key.tokens_per_minute,
            self.settled_s or self.retention_s,
            item.replica,
            item.key.id,
            item.model,
            now.strftime("d:%Y%m%d"),
            now.strftime("m:%Y%m"),
            cost.input_nanos,
            cost.output_nanos,
            cost.reserved_nanos,
            cost.cached_prompt_tokens,
            "1" if ship else "0",
            origin.http_request_id if origin else "",
            str(origin.admitted_ms) if origin else "",
            "1" if item.taken_back else "",
            item.failover,
        ]

    async def settle_many(self, settlements: list[Settlement]) -> list[tuple[bool, Settled | None]]:
        """Settle several requests in one pipeline (retries after Redis was
        unreachable). Returns, per item, whether Redis answered for it (an answered
        settle is done, whatever it did) and what ``settle`` returns."""
        items = [Settlement(*item) for item in settlements]
        calls = [
            (
                self._settle,
                redis_names.admission_keys(item.key.id, item.request_id),
                self._settle_args(item),
            )
            for item in items
        ]
        replies = await self._script_batch(calls)
        return [
            (False, None) if isinstance(reply, BaseException) else (True, _settled(item.request_id, reply))
            for item, reply in zip(items, replies)
        ]

    async def renew(self, running: dict[str, list[str]]) -> int:
        """Renew the leases of running requests, ``{key id: [request ids]}``, in
        one pipeline (one script call per key). Returns leases renewed."""
        if not running:
            return 0
        calls = [
            (
                self._renew,
                [redis_names.concurrency(key_id)] + [redis_names.request_record(key_id, r) for r in request_ids],
                [self.lease_ms, *request_ids],
            )
            for key_id, request_ids in running.items()
        ]
        replies = await self._script_batch(calls)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return sum(int(reply) for reply in replies)

    # -- requests no ingress will settle (it died): the due index and the reaper ---------

    def register_due(self, account_ids: list[str], due_ms: int) -> list[asyncio.Future]:
        """Put ``account_ids`` in the due index no later than ``due_ms`` (reap.lua runs
        for them then; a registration never puts off a due time, due.lua). Called in the
        turn that sends their admissions, so both go out in the same pipeline flush: an
        ingress that dies after admitting has registered the account too."""
        return [
            self.pipeline.call(
                self._due, [redis_names.LEASES_DUE, redis_names.LEASES_SEEN], ["register", account, due_ms]
            )
            for account in account_ids
        ]

    async def due_accounts(self, limit: int = 100) -> list[str]:
        """Accounts whose leases may have expired by now (Redis' clock), in one call."""
        due = await self.pipeline.call(self._due, [redis_names.LEASES_DUE, redis_names.LEASES_SEEN], ["due", limit])
        return [_text(account) for account in due]

    async def reap(self, account_id: str) -> tuple[int, list[dict[str, Any]]]:
        """Finalise ``account_id``'s requests whose leases expired (reap.lua), and take
        it off the due index (or set when it is next due). Returns its earliest live
        lease's expiry (-1: none) and the final records to ship (an API key's, with a
        sink; a team's stay in Redis, as its settled records do)."""
        ship = self.settled_s is not None and not is_team_id(account_id)
        next_ms, finals, reaped_at = await self.pipeline.call(
            self._reap,
            [redis_names.concurrency(account_id), redis_names.usage(account_id)],
            [redis_names.request_record_prefix(account_id), self.settled_s or self.retention_s, "1" if ship else "0"],
        )
        await self.pipeline.call(
            self._due,
            [redis_names.LEASES_DUE, redis_names.LEASES_SEEN],
            # Guarded for a lease: longer than an ingress counts on a registration (half a lease).
            ["reaped", account_id, int(reaped_at), int(next_ms), self.lease_ms, self.lease_ms * 3 // 2],
        )
        records = [
            as_state(_text(finals[i]), dict(zip(finals[i + 1][::2], finals[i + 1][1::2])))
            for i in range(0, len(finals), 2)
        ]
        return int(next_ms), records

    async def _script_batch(self, calls: list[tuple]) -> list:
        """Run ``(script, keys, args)`` calls now, in one pipeline (one per node on
        a cluster); per call, its reply or the error Redis answered it with.
        Raises what failed them all (Redis unreachable)."""
        replies = []
        for start in range(0, len(calls), self.pipeline.max_pipeline):
            replies += await self.pipeline.run(calls[start : start + self.pipeline.max_pipeline])
        return replies


@dataclass(frozen=True)
class Settled:
    delta: int  # tokens charged beyond the reservation (negative: given back)
    # The final record for the record sink (record_shipper.py): only with a sink,
    # only at the request's own key's level (a team's copy stays in Redis settled_s).
    record: dict[str, Any] | None = None


def _settled(request_id: str, reply) -> Settled | None:
    """settle.lua's reply: false (settled already), the delta, or {delta, the record's fields}."""
    if reply is None or reply is False:
        return None
    if isinstance(reply, list):
        fields = reply[1]
        return Settled(int(reply[0]), as_state(request_id, dict(zip(fields[::2], fields[1::2]))))
    return Settled(int(reply))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
