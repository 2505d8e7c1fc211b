"""Every Redis key the gateway uses, named in one place.

Keys that belong to one API key share the hash tag ``{k:<key_id>}`` so each
script touching them runs on one slot of a Redis Cluster (docs/architecture.md, State).
A team is admitted like a key (identity/teams.py): its limits' state has the same
names under its team id (``t…``, so ``{k:t…}``), one slot per team.
"""

from __future__ import annotations

import functools

PREFIX = "llm"


def tag(key_id: str) -> str:
    return "{k:" + key_id + "}"


def key_record(key_id: str) -> str:
    return f"{PREFIX}:key:{tag(key_id)}"


def key_secret_digest(key_id: str) -> str:
    """Key id → its secret's digest (kept apart from the record, which is shown)."""
    return f"{PREFIX}:keysecret:{tag(key_id)}"


def key_digest(digest: str) -> str:
    """Secret digest → key id (the lookup an incoming request needs)."""
    return f"{PREFIX}:keydigest:{digest}"


def key_name(name: str) -> str:
    """Key name → key id (names are unique)."""
    return f"{PREFIX}:keyname:{name}"


KEY_INDEX = f"{PREFIX}:keys"


def team_record(team_id: str) -> str:
    return f"{PREFIX}:team:{tag(team_id)}"


def team_name(name: str) -> str:
    """Team name → team id (names are unique)."""
    return f"{PREFIX}:teamname:{name}"


def team_members(team_id: str) -> str:
    """Set of the ids of the team's keys."""
    return f"{PREFIX}:teamkeys:{tag(team_id)}"


TEAM_INDEX = f"{PREFIX}:teams"


def token_user(user_id: str) -> str:
    """An identity-token user the gateway admitted: its name and team (identity/token_users.py)."""
    return f"{PREFIX}:tokenuser:{tag(user_id)}"


def token_user_name(name: str) -> str:
    """An identity-token user's name (``jwt:<user>``) → its id."""
    return f"{PREFIX}:tokenusername:{name}"


# The identity-token users seen lately, scored by when each was last admitted.
TOKEN_USER_INDEX = f"{PREFIX}:tokenusers"

# The audit trail of admin actions: one stream (serve_app/accounting/audit.py).
AUDIT_LOG = f"{PREFIX}:audit"


def admin_record(name: str) -> str:
    """A named admin credential (serve_app/identity/admins.py)."""
    return f"{PREFIX}:admin:{name}"


def admin_secret_digest(name: str) -> str:
    return f"{PREFIX}:adminsecret:{name}"


def admin_digest(digest: str) -> str:
    """Admin secret digest → the admin's name (apart from API keys' digests)."""
    return f"{PREFIX}:admindigest:{digest}"


ADMIN_INDEX = f"{PREFIX}:admins"


def admin_failures(client_digest: str, minute: int) -> str:
    """Failed admin credentials of one client (its address's digest) in one clock minute
    (serve_app/identity/credential_guard.py)."""
    return f"{PREFIX}:adminfail:{client_digest}:{minute}"


def console_session(token_digest: str) -> str:
    """An operator console session (its cookie's digest) → the admin it acts for."""
    return f"{PREFIX}:consolesession:{token_digest}"


def requests_rate(key_id: str) -> str:
    return f"{PREFIX}:rpm:{tag(key_id)}"


def tokens_rate(key_id: str) -> str:
    return f"{PREFIX}:tpm:{tag(key_id)}"


def concurrency(key_id: str) -> str:
    return f"{PREFIX}:conc:{tag(key_id)}"


def usage(key_id: str) -> str:
    """Hash of per-period counters: ``d:YYYYMMDD:tokens``, ``m:YYYYMM:requests``, ..."""
    return f"{PREFIX}:usage:{tag(key_id)}"


def refusals(key_id: str) -> str:
    """Hash of refusal counts per minute and kind (``<epoch minute>:<kind>``), kept an hour."""
    return f"{PREFIX}:refused:{tag(key_id)}"


def request_record_prefix(key_id: str) -> str:
    return f"{PREFIX}:req:{tag(key_id)}:"


def request_record(key_id: str, request_id: str) -> str:
    return request_record_prefix(key_id) + request_id


def http_request(http_request_id: str, key_id: str | None = None) -> str:
    """The HTTP x-request-id (Ray Serve's, or the client's own) → the gateway's
    request id: of the first request that used it, or with ``key_id`` of that
    key's last one (a client may reuse any id; another key's never replaces it)."""
    if key_id is not None:
        return f"{PREFIX}:httpreq:{tag(key_id)}:{http_request_id}"
    return f"{PREFIX}:httpreq:{http_request_id}"


def admission_keys(key_id: str, request_id: str) -> list[str]:
    """KEYS of the admission, running and settle scripts, in their order
    (all under the key's hash tag: one slot); the last is the account's record,
    whose limits admission applies."""
    rate, tokens, leases, counters, record_prefix, refused, limits = _key_names(key_id)
    return [rate, tokens, leases, counters, record_prefix + request_id, refused, limits]


def limits_record(account_id: str) -> str:
    """Where an account's limits are stored: a team's record (ids ``t…``) or an API
    key's (an identity-token user, ``j…``, has none: its limits are configured)."""
    return team_record(account_id) if account_id.startswith("t") else key_record(account_id)


def has_stored_limits(account_id: str) -> bool:
    """Whether the account's limits live in Redis (API keys and teams), where
    admission reads them, rather than in the gateway's configuration."""
    return not account_id.startswith("j")


@functools.lru_cache(maxsize=4096)
def _key_names(key_id: str) -> tuple[str, ...]:
    """One key's admission names, made once per key (twice per request otherwise)."""
    return (
        requests_rate(key_id),
        tokens_rate(key_id),
        concurrency(key_id),
        usage(key_id),
        request_record_prefix(key_id),
        refusals(key_id),
        limits_record(key_id),
    )


def stored_response(key_id: str, response_id: str) -> str:
    """A Responses API response stored for its key (``store``), with its conversation."""
    return f"{PREFIX}:resp:{tag(key_id)}:{response_id}"


def file_record(key_id: str, file_id: str) -> str:
    """An uploaded file's (or a batch output's) metadata; its content is in the files directory."""
    return f"{PREFIX}:file:{tag(key_id)}:{file_id}"


def file_index(key_id: str) -> str:
    """Sorted set of the key's file ids by creation time (listing)."""
    return f"{PREFIX}:files:{tag(key_id)}"


def file_space(key_id: str) -> str:
    """Hash of the bytes of each of the key's files (and their ``total``): its storage quota."""
    return f"{PREFIX}:filespace:{tag(key_id)}"


def file_space_expiry(key_id: str) -> str:
    """Sorted set of the key's file ids by when they stop counting (ms)."""
    return f"{PREFIX}:filespacexp:{tag(key_id)}"


def stored_space(key_id: str) -> str:
    """Hash of the bytes of each object the key keeps in Redis (stored responses,
    batch records; and their ``total``): its storage account."""
    return f"{PREFIX}:storespace:{tag(key_id)}"


def stored_space_expiry(key_id: str) -> str:
    """Sorted set of the key's stored objects by when they stop counting (ms)."""
    return f"{PREFIX}:storespacexp:{tag(key_id)}"


def batch_record(key_id: str, batch_id: str) -> str:
    """Hash of one batch: its fixed fields as JSON, its status, times and counts as fields."""
    return f"{PREFIX}:batch:{tag(key_id)}:{batch_id}"


def batch_index(key_id: str) -> str:
    """Sorted set of the key's batch ids by creation time (listing)."""
    return f"{PREFIX}:batches:{tag(key_id)}"


def active_batches_of(key_id: str) -> str:
    """Sorted set of the key's batches not ended yet, by creation time: its bound."""
    return f"{PREFIX}:batchesactive:{tag(key_id)}"


# Every key's ``active_batches_of`` (a SCAN pattern): what ``ACTIVE_BATCHES`` is rebuilt from.
ACTIVE_BATCHES_OF_ANY_KEY = f"{PREFIX}:batchesactive:*"


def key_of_active_batches(name: str) -> str:
    """The key id an ``active_batches_of`` name belongs to."""
    return name.split(":{k:", 1)[1].rsplit("}", 1)[0]


def batch_unstored(key_id: str, batch_id: str) -> str:
    """Hash of a batch's requests that ran and whose answers were not kept (custom_id ->
    why: its key's storage bound, or a write that failed): never run again."""
    return f"{PREFIX}:batchunstored:{tag(key_id)}:{batch_id}"


def batch_lease(key_id: str, batch_id: str) -> str:
    """Which ingress replica runs the batch now (expires unless renewed)."""
    return f"{PREFIX}:batchlease:{tag(key_id)}:{batch_id}"


# Set of "<key id>/<batch id>" of the batches not finished yet: what runners look at.
# One slot for every key: a write it loses (a failover) is made again from each key's
# ``active_batches_of`` by the runners' reconciliation (batches.py ``reconcile``).
ACTIVE_BATCHES = f"{PREFIX}:batches:active"
# A runner's claim on the next reconciliation (one replica of all does it, each period).
BATCH_RECONCILER = f"{PREFIX}:batches:reconciler"
# Final request records on their way to the record sink (record_shipper.py): a stream.
RECORD_OUTBOX = f"{PREFIX}:records:outbox"
# Accounts (keys, teams) with leases, scored by when those may have expired: where the
# reaper looks for requests a dead ingress left (serve_app/admission/lua/reap.lua).
# One member per account with live leases; an account leaves it once reaped with none left.
LEASES_DUE = f"{PREFIX}:leases:due"
# When each account in LEASES_DUE was last registered (ms); its hash tag is LEASES_DUE's
# whole name, so both are in one slot (due.lua reads them together).
LEASES_SEEN = "{" + LEASES_DUE + "}:seen"

# The secret every process salts tenants' prompt caches with (serve_app/identity/cache_isolation.py):
# made once by whichever process needs it first, never shown.
CACHE_SALT_SECRET = f"{PREFIX}:cache-salt-secret"
