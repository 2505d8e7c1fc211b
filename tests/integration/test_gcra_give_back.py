"""Rate limits hold on what each request's record says it cost, whatever was given
back and when (serve_app/admission/lua/gcra.lua). Taking a request back (its team
refused it, or it is admitted again at another size) and settling one for fewer
tokens than it reserved move a limit's state back; a request admitted after it that
found the state in the past then got more room than history without it allows. The
soak's ledger caught it (a key's 58th request in 55.97 s at 30/min, 31 ms early).
Here: that history on a real redis-server, and any history of admissions, pauses,
take-backs and settlements as a property, judged by the soak's own window check
(soak/ledger.py worst_window: GCRA's bound L + L·s/60 over every span)."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.admission.scripts import AdmissionScripts
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_client, redis_names
from soak.ledger import worst_window

_keys = itertools.count()
EXACT = 1e-6  # every time is Redis' integer ms and every emission interval below is whole


def _key(**limits) -> KeyRecord:
    return KeyRecord(id=f"kgcra{next(_keys):08d}", name="gcra", created_at=0, **limits)


async def _surviving(redis, key: KeyRecord, request_ids: list[str]) -> list[dict]:
    """The records of the requests not taken back, each with what it finally cost."""
    records = []
    for request_id in request_ids:
        fields = await redis.hgetall(redis_names.admission_keys(key.id, request_id)[4])
        fields = {name.decode() if isinstance(name, bytes) else name: value for name, value in fields.items()}
        if fields:
            records.append(fields)
    return sorted(records, key=lambda fields: int(fields["received_ms"]))


def _final_tokens(record: dict) -> int:
    """Its usage once settled (what tokens/min keeps), its reservation until then."""
    return int(record.get("total_tokens") or record["reserved_tokens"])


def _excess(records: list[dict], limit: int, weight) -> float:
    return worst_window([int(r["received_ms"]) for r in records], [weight(r) for r in records], limit)[0]


async def _burst_then_one_more(adm: AdmissionScripts, key: KeyRecord, request_ids: list[str]) -> None:
    """Requests of one request/min each up to the limit, then one more as soon as the
    limit lets it in (it lands early by whatever was given back beyond history)."""
    refused = False
    for request_id in request_ids:
        decision = await adm.admit(key, request_id, "m", 1)
        if refused and decision.admitted:
            return
        refused = refused or not decision.admitted
        if refused:
            await asyncio.sleep(0.005)
    raise AssertionError("the limit never let one more in")


async def test_taking_back_the_first_of_a_burst_gives_no_idle_time_back(redis):
    key = _key(requests_per_minute=120)  # 500 ms a request
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    first = f"{key.id}-first"
    assert (await adm.admit(key, first, "m", 1)).admitted  # the state was empty: its clock starts here
    await asyncio.sleep(0.2)
    ids = [f"{key.id}-{n}" for n in range(400)]
    for request_id in ids[:5]:
        assert (await adm.admit(key, request_id, "m", 1)).admitted
    assert await adm.release(key, first, "team_requests")  # its team refused it
    await _burst_then_one_more(adm, key, ids[5:])
    records = await _surviving(redis, key, ids)
    assert len(records) >= 121
    assert _excess(records, 120, lambda r: 1) <= EXACT


async def test_a_limit_lowered_between_a_request_and_its_take_back_gives_no_more_back(redis):
    # Taken back under the limit it came under (120/min: 500 ms), after a request under
    # the lowered one (60/min: 1 s) found the state in the past: what came since is
    # counted in time, at its own limit's interval, not at the taken-back request's.
    fast = _key(requests_per_minute=120)
    slow = fast.model_copy(update={"requests_per_minute": 60})
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    first = f"{fast.id}-first"
    assert (await adm.admit(fast, first, "m", 1)).admitted
    await asyncio.sleep(0.6)  # the state is in the past
    ids = [f"{slow.id}-{n}" for n in range(400)]
    assert (await adm.admit(slow, ids[0], "m", 1)).admitted
    assert await adm.release(fast, first, "team_requests")
    await _burst_then_one_more(adm, slow, ids[1:])
    records = await _surviving(redis, slow, ids)
    assert len(records) >= 61
    assert _excess(records, 60, lambda r: 1) <= EXACT


# A history: requests, each after a pause, of some cost, and its fate once k more
# requests have come: kept, taken back (its team refused it; admitted again at another
# size), settled for a share of what it reserved, or cancelled (usage unknown: the
# reservation stays charged).
FATES = st.one_of(
    st.just(("keep",)),
    st.just(("take back",)),
    st.tuples(st.just("settle"), st.sampled_from([0.0, 0.1, 0.5, 0.9])),
    st.just(("cancel",)),
)
HISTORY = st.lists(
    st.tuples(
        st.sampled_from([0, 3, 30, 70, 150, 250]),  # ms before it
        st.sampled_from([1, 2, 5, 20, 100, 400]),  # tokens it reserves
        FATES,
        st.integers(0, 3),  # requests admitted after it before its fate
        st.booleans(),  # admitted under the limit halved (an operator lowered it meanwhile)
    ),
    min_size=2,
    max_size=10,
)
# One limit at a time, each with a whole emission interval: requests/min at 600
# (100 ms a request), tokens/min at 3,000 (20 ms a token). Pauses of tens of ms leave
# the state in the past between admissions.
# Each record weighs its cost in emission time at its own limit (kept in the record), in
# units of the full limit's interval: GCRA keeps the time charged over any span within
# 60 s + the span, whatever limit each request came under.
LIMITS = {
    "requests_per_minute": (600, lambda r: 600 / int(r["rpm"])),
    "tokens_per_minute": (3000, lambda r: _final_tokens(r) * 3000 / int(r["tpm"])),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=st.sampled_from(sorted(LIMITS)), history=HISTORY)
def test_every_history_keeps_the_rate_limit_on_final_costs(redis_server, limit, history):
    """Any history, then a probe that fills the limit and takes one more as soon as
    it admits: that one lands early by exactly what was given back beyond what
    history without it allows."""
    asyncio.run(_history(redis_server.url, limit, history))


async def _history(url: str, limit: str, history) -> None:
    redis = redis_client.connect(url)
    value, weight = LIMITS[limit]
    key = _key(**{limit: value})
    lowered = key.model_copy(update={limit: value // 2})
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    admitted: list[str] = []
    pending: list[tuple[int, str, int, tuple]] = []  # (due after this many admissions, id, reserved, fate)

    async def meet_fates(due: int) -> None:
        for entry in [entry for entry in pending if entry[0] <= due]:
            pending.remove(entry)
            _, request_id, reserved, fate = entry
            if fate[0] == "take back":
                assert await adm.release(key, request_id, "")
            elif fate[0] == "settle":  # the reservation is an upper bound: never more
                await adm.settle(key, request_id, "completed", int(reserved * fate[1]), 0)
            elif fate[0] == "cancel":
                await adm.settle(key, request_id, "cancelled", -1, 0)

    try:
        for number, (pause_ms, tokens, fate, later, halved) in enumerate(history):
            await asyncio.sleep(pause_ms / 1000)
            request_id = f"{key.id}-{number}"
            if (await adm.admit(lowered if halved else key, request_id, "m", tokens)).admitted:
                admitted.append(request_id)
                await meet_fates(len(admitted))
                pending.append((len(admitted) + later, request_id, tokens, fate))
        await meet_fates(10**9)
        # The probe: 100-token requests until refused, 1-token ones until refused (the
        # limit is full to the token), then one more as soon as it admits.
        cost, refusals = 100, 0
        for number in range(len(history), len(history) + 3000):
            request_id = f"{key.id}-{number}"
            if (await adm.admit(key, request_id, "m", cost)).admitted:
                admitted.append(request_id)
                if refusals == 2:
                    break
            else:
                refusals, cost = min(refusals + 1, 2), 1
                if refusals == 2:
                    await asyncio.sleep(0.005)
        else:
            raise AssertionError("the probe never got one more in")
        records = await _surviving(redis, key, admitted)
        assert _excess(records, value, weight) <= EXACT
    finally:
        await redis.aclose()
