"""Who changed what, and when: the audit trail of admin actions (keys created,
changed, revoked; batches cancelled), written the same way whether the action came
through the admin API or `llmctl`, since both go through admin/operations.py.

One Redis stream (``redis_names.AUDIT_LOG``); an entry's stream id is its time. An
entry names its actor, the action, its target and the values before and after
(only the fields that changed; a secret is never written: a created key's entry
holds its record, not its secret). Bounded twice at every write: entries older
than ``RETENTION_S`` are trimmed, and the stream never holds more than
``MAX_ENTRIES``, so a flood of admin calls cannot grow Redis without bound."""

from __future__ import annotations

import getpass
import json
import re
import socket
import time
from typing import Any

from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text

RETENTION_S = 400 * 86400  # a year and a month: last year's audit is still there
MAX_ENTRIES = 20_000
# Entries read per XREVRANGE while filtering a page (by actor or target).
_SCAN_BATCH = 500
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


def llmctl_actor() -> str:
    """Who runs `llmctl`: the operating-system user on this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        user = "uid-unknown"
    return f"llmctl:{user}@{socket.gethostname()}"


def changed(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields that differ, as (before, after)."""
    fields = [name for name in after if before.get(name) != after[name]]
    return {name: before.get(name) for name in fields}, {name: after[name] for name in fields}


class AuditLog:
    def __init__(self, redis):
        self.redis = redis

    async def record(
        self,
        actor: str,
        action: str,
        target: str,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
    ) -> str:
        """Append one entry; returns its id."""
        oldest_ms = int((time.time() - RETENTION_S) * 1000)
        fields = {
            "actor": actor,
            "action": action,
            "target": target,
            "before": json.dumps(before, separators=(",", ":")),
            "after": json.dumps(after, separators=(",", ":")),
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(redis_names.AUDIT_LOG, fields, minid=oldest_ms, approximate=False)
            pipe.xtrim(redis_names.AUDIT_LOG, maxlen=MAX_ENTRIES, approximate=False)
            entry_id, _ = await pipe.execute()
        return as_text(entry_id)

    async def read(
        self, limit: int = 100, before: str | None = None, actor: str | None = None, target: str | None = None
    ) -> dict[str, Any]:
        """A page of entries, newest first, older than the entry ``before`` (an id
        of the previous page), only those of ``actor`` and ``target`` if given."""
        if before is not None and not _STREAM_ID.fullmatch(before):
            raise ValueError(f"'before' must be an entry id such as '1764201600000-0', not {before!r}")
        upper = f"({before}" if before else "+"
        page: list[dict[str, Any]] = []
        while len(page) < limit:
            rows = await self.redis.xrevrange(redis_names.AUDIT_LOG, max=upper, min="-", count=_SCAN_BATCH)
            for entry_id, fields in rows:
                entry = _entry(entry_id, fields)
                if (actor is None or entry["actor"] == actor) and (target is None or entry["target"] == target):
                    page.append(entry)
                    if len(page) == limit:
                        break
            if len(rows) < _SCAN_BATCH:
                break
            upper = f"({as_text(rows[-1][0])}"
        more = bool(page) and bool(
            await self.redis.xrevrange(redis_names.AUDIT_LOG, max=f"({page[-1]['id']}", min="-", count=1)
        )
        return {"object": "list", "data": page, "has_more": len(page) == limit and more}


def _entry(entry_id, fields: dict) -> dict[str, Any]:
    values = {as_text(name): as_text(value) for name, value in fields.items()}
    entry_id = as_text(entry_id)
    return {
        "id": entry_id,
        "at": int(entry_id.split("-")[0]) / 1000,
        "actor": values["actor"],
        "action": values["action"],
        "target": values["target"],
        "before": json.loads(values["before"]),
        "after": json.loads(values["after"]),
    }
