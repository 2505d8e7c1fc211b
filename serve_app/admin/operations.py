"""The admin operations, for the admin API and `llmctl` alike: the same key store
and records, and every change written to the audit trail (audit.py) with who
made it (``actor``).

Each function takes the ``AdminStores`` (the stores over one Redis client, built
once by the ingress' service builder or by `llmctl`) and plain request data and
returns JSON-ready data or raises ``OpenAIError``; the ingress and `llmctl` only route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from contract.model_config import PriorityTier
from serve_app.accounting import usage_report
from serve_app.accounting.audit import AuditLog, changed
from serve_app.accounting.record_shipper import RecordShipper
from serve_app.accounting.usage import key_usage, request_state
from serve_app.errors import OpenAIError, invalid_request
from serve_app.identity.admins import AdminNotFound, AdminStore
from serve_app.identity.keys import KeyNotFound, KeyRecord, KeyStore
from serve_app.identity.teams import TeamNotFound, TeamRecord, TeamStore
from serve_app.identity.token_users import TokenUsers
from serve_app.limits import KeyLimits


@dataclass(frozen=True)
class AdminStores:
    """What the admin operations read and change, over one Redis client."""

    redis: Any
    keys: KeyStore
    teams: TeamStore
    admins: AdminStore
    audit: AuditLog
    token_users: TokenUsers
    records: RecordShipper | None = None  # where final request records went past Redis (None: kept in Redis)

    @classmethod
    def over(cls, redis, records: RecordShipper | None = None) -> AdminStores:
        return cls(
            redis, KeyStore(redis), TeamStore(redis), AdminStore(redis), AuditLog(redis), TokenUsers(redis), records
        )


# A key's, team's or admin's name: shown in the console, the audit trail, 429s and
# metrics' labels, so never empty, blank, control characters or unbounded.
def _printable_name(name: str) -> str:
    if not name.strip():
        raise ValueError("a name must not be empty or blank")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        raise ValueError("a name must not contain control characters")
    return name


Name = Annotated[str, Field(max_length=200), AfterValidator(_printable_name)]


class NewKey(KeyLimits):
    name: Name
    team: str | None = None  # a team's id or name


class NewTeam(KeyLimits):
    name: Name


class NewAdmin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name


class TeamChanges(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[str] | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    daily_token_budget: int | None = None
    monthly_token_budget: int | None = None
    priority: PriorityTier | None = None
    enabled: bool | None = None
    daily_cost_budget_usd: float | None = None
    monthly_cost_budget_usd: float | None = None


class KeyChanges(TeamChanges):
    team: str | None = None  # a team's id or name; null: no team (moving a key between teams)


Parsed = TypeVar("Parsed", bound=BaseModel)


def _parse(model: type[Parsed], body: Any) -> Parsed:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None


async def _key(stores: AdminStores, id_or_name: str) -> KeyRecord:
    try:
        return await stores.keys.resolve(id_or_name)
    except KeyNotFound:
        raise OpenAIError(404, f"No API key '{id_or_name}'.", code="key_not_found") from None


async def _account(stores: AdminStores, id_or_name: str) -> KeyRecord:
    """Who used something: a stored key, or else an identity-token user the gateway
    admitted (by its ``j…`` id or ``jwt:<user>`` name): usage is theirs alike."""
    try:
        return await stores.keys.resolve(id_or_name)
    except KeyNotFound:
        pass
    try:
        return await stores.token_users.resolve(id_or_name)
    except KeyNotFound:
        raise OpenAIError(404, f"No API key or identity-token user '{id_or_name}'.", code="key_not_found") from None


async def accounts(stores: AdminStores) -> list[KeyRecord]:
    """Every stored key and every identity-token user seen in the usage report's window."""
    return [*await stores.keys.list(), *await stores.token_users.list()]


async def account(stores: AdminStores, id_or_name: str) -> dict[str, Any]:
    """A stored key's record, or an identity-token user's (its id, name and team)."""
    return (await _account(stores, id_or_name)).model_dump()


async def _team(stores: AdminStores, id_or_name: str) -> TeamRecord:
    try:
        return await stores.teams.resolve(id_or_name)
    except TeamNotFound:
        raise OpenAIError(404, f"No team '{id_or_name}'.", param="team", code="team_not_found") from None


async def _team_to_join(stores: AdminStores, id_or_name: str) -> TeamRecord:
    """A team a key may be put in: an enabled one."""
    team = await _team(stores, id_or_name)
    if not team.enabled:
        raise OpenAIError(
            400, f"The team '{team.name}' is disabled: no key can join it.", param="team", code="team_disabled"
        )
    return team


async def create_key(stores: AdminStores, body: Any, actor: str) -> dict[str, Any]:
    new = _parse(NewKey, body)
    limits = new.model_dump(exclude={"name", "team"})
    team = await _team_to_join(stores, new.team) if new.team is not None else None
    if team is not None and "priority" not in new.model_fields_set:
        limits["priority"] = team.priority  # the team's default tier
    try:
        record, secret = await stores.keys.create(new.name, KeyLimits(**limits))
    except ValueError as exc:
        raise OpenAIError(409, str(exc), param="name", code="key_exists") from None
    if team is not None:
        record = await stores.keys.update(record.id, team=team.id)
        await stores.teams.set_membership(record.id, None, team.id)
    await stores.audit.record(actor, "key.create", record.id, after=record.model_dump())
    return {**record.model_dump(), "secret": secret}


async def list_keys(stores: AdminStores) -> dict[str, Any]:
    return {"object": "list", "data": [r.model_dump() for r in await stores.keys.list()]}


async def show_key(stores: AdminStores, id_or_name: str) -> dict[str, Any]:
    return (await _key(stores, id_or_name)).model_dump()


async def update_key(stores: AdminStores, id_or_name: str, body: Any, actor: str) -> dict[str, Any]:
    changes = _parse(KeyChanges, body).model_dump(exclude_unset=True)
    record = await _key(stores, id_or_name)
    if changes.get("team") is not None:
        changes["team"] = (await _team_to_join(stores, changes["team"])).id
    try:
        updated = await stores.keys.update(record.id, **changes)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    if updated.team != record.team:
        # Admission reads the key record (within key_cache_ttl_s at every ingress): from
        # then on the new team's limits apply; requests running stay counted where admitted.
        await stores.teams.set_membership(record.id, record.team, updated.team)
    await stores.audit.record(actor, "key.update", record.id, *changed(record.model_dump(), updated.model_dump()))
    return updated.model_dump()


async def revoke_key(stores: AdminStores, id_or_name: str, actor: str) -> dict[str, Any]:
    record = await _key(stores, id_or_name)
    revoked = await stores.keys.revoke(record.id)
    await stores.audit.record(actor, "key.revoke", record.id, *changed(record.model_dump(), revoked.model_dump()))
    return revoked.model_dump()


async def create_team(stores: AdminStores, body: Any, actor: str) -> dict[str, Any]:
    new = _parse(NewTeam, body)
    try:
        record = await stores.teams.create(new.name, KeyLimits(**new.model_dump(exclude={"name"})))
    except ValueError as exc:
        raise OpenAIError(409, str(exc), param="name", code="team_exists") from None
    await stores.audit.record(actor, "team.create", record.id, after=record.model_dump())
    return record.model_dump()


async def list_teams(stores: AdminStores) -> dict[str, Any]:
    return {"object": "list", "data": [r.model_dump() for r in await stores.teams.list()]}


async def show_team(stores: AdminStores, id_or_name: str) -> dict[str, Any]:
    team = await _team(stores, id_or_name)
    return {
        **team.model_dump(),
        "keys": await stores.teams.members(team.id),
        "usage": await key_usage(stores.redis, team.id),
    }


async def update_team(stores: AdminStores, id_or_name: str, body: Any, actor: str) -> dict[str, Any]:
    changes = _parse(TeamChanges, body).model_dump(exclude_unset=True)
    team = await _team(stores, id_or_name)
    try:
        updated = await stores.teams.update(team.id, **changes)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    await stores.audit.record(actor, "team.update", team.id, *changed(team.model_dump(), updated.model_dump()))
    return updated.model_dump()


async def revoke_team(stores: AdminStores, id_or_name: str, actor: str) -> dict[str, Any]:
    """Disable a team: every key of it stops (interactive requests within
    key_cache_ttl_s, running streams and batches at their next check)."""
    team = await _team(stores, id_or_name)
    revoked = await stores.teams.update(team.id, enabled=False)
    await stores.audit.record(actor, "team.revoke", team.id, *changed(team.model_dump(), revoked.model_dump()))
    return revoked.model_dump()


async def usage(stores: AdminStores, id_or_name: str) -> dict[str, Any]:
    record = await _account(stores, id_or_name)
    return {"key": record.name, "id": record.id, **await key_usage(stores.redis, record.id)}


async def completions_usage(stores: AdminStores, params) -> dict[str, Any]:
    """OpenAI's organization Usage API for completions (usage_report.py), over every key
    and identity-token user."""
    query = usage_report.parse_query(params)
    return await usage_report.completions_usage(stores.redis, await accounts(stores), query)


async def costs(stores: AdminStores, params) -> dict[str, Any]:
    """OpenAI's organization Costs API (usage_report.py), over every key and
    identity-token user."""
    query = usage_report.parse_query(params, usage_report.COST_GROUPS)
    return await usage_report.costs(stores.redis, await accounts(stores), query)


async def request(stores: AdminStores, request_id: str, key: str | None = None) -> dict[str, Any]:
    """A request's record; ``key`` (id or name) looks an x-request-id up among that key's requests."""
    key_id = (await _key(stores, key)).id if key is not None else None
    try:
        sink = stores.records.sink if stores.records is not None else None  # records past Redis' recent window
        state = await request_state(stores.redis, request_id, key_id, sink)
    except ValueError:
        state = None
    if state is None:
        raise OpenAIError(404, f"No record of request '{request_id}'.", code="request_not_found")
    return state


async def list_batches(stores: AdminStores, batches, key: str | None, limit: int, after: str | None) -> dict[str, Any]:
    """One key's batches (a page, newest first), or with no key every batch not
    ended yet, of every key; each names its key (``key_id``)."""
    if key is not None:
        record = await _key(stores, key)
        page = await batches.page(record.id, limit, after)
        page["data"] = [{**batch, "key_id": record.id} for batch in page["data"]]
        return page
    data = []
    for key_id, batch_id in await batches.active():
        try:
            data.append({**await batches.get(key_id, batch_id), "key_id": key_id})
        except OpenAIError:  # ended and expired meanwhile
            continue
    return {"object": "list", "data": data, "has_more": False}


async def cancel_batch(stores: AdminStores, batches, batch_id: str, actor: str) -> dict[str, Any]:
    """Cancel any key's batch not ended yet (404 for one that ended: nothing to stop)."""
    key_id = await batches.key_of(batch_id)
    cancelled = await batches.cancel(key_id, batch_id)
    await stores.audit.record(actor, "batch.cancel", batch_id, after={"key_id": key_id, "status": cancelled["status"]})
    return {**cancelled, "key_id": key_id}


async def audit_trail(
    stores: AdminStores,
    limit: Any = 100,
    before: str | None = None,
    actor: str | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """A page of the audit trail, newest first (``before``: the last id of the previous page)."""
    try:
        limit = int(limit)
    except (TypeError, ValueError):
        limit = 0
    if not 1 <= limit <= 1000:
        raise OpenAIError(400, "'limit' must be an integer from 1 to 1000.", param="limit")
    try:
        return await stores.audit.read(limit, before, actor, target)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="before") from None


async def create_admin(stores: AdminStores, body: Any, actor: str) -> dict[str, Any]:
    """A named admin credential; its secret is in this answer only."""
    new = _parse(NewAdmin, body)
    try:
        record, secret = await stores.admins.create(new.name, actor)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="name") from None
    except FileExistsError as exc:
        raise OpenAIError(409, str(exc), param="name", code="admin_exists") from None
    await stores.audit.record(actor, "admin.create", f"admin:{record.name}", after=record.model_dump())
    return {**record.model_dump(), "secret": secret}


async def list_admins(stores: AdminStores) -> dict[str, Any]:
    return {"object": "list", "data": [r.model_dump() for r in await stores.admins.list()]}


async def revoke_admin(stores: AdminStores, name: str, actor: str) -> dict[str, Any]:
    try:
        record = await stores.admins.revoke(name)
    except AdminNotFound:
        raise OpenAIError(404, f"No admin '{name}'.", code="admin_not_found") from None
    await stores.audit.record(actor, "admin.revoke", f"admin:{name}", before=record.model_dump())
    return record.model_dump()
