"""The audit trail of admin actions on a real Redis (one node, a Cluster, Sentinel):
what `llmctl` and the admin operations record, who is named, what is never written
(a secret), how a page is read, and the bounds that keep it from growing."""

from __future__ import annotations

import json
import time

import pytest
from redis_server import running_redis

from serve_app.accounting import audit
from serve_app.accounting.audit import AuditLog, llmctl_actor
from serve_app.admin import operations as admin
from serve_app.cli import main
from serve_app.errors import OpenAIError
from serve_app.http.services import build_quota_services
from serve_app.identity.admins import ADMIN_TOKEN_ACTOR
from serve_app.identity.keys import digest
from serve_app.redis_store import redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry


def llmctl(capsys, redis_url, *argv):
    code = main(["--redis-url", redis_url, *argv])
    return code, capsys.readouterr()


def test_llmctl_key_changes_are_recorded_with_who_what_before_and_after(capsys, redis_url):
    code, out = llmctl(capsys, redis_url, "keys", "create", "audit-cli", "--rpm", "60", "--json")
    created = json.loads(out.out)
    assert code == 0
    assert llmctl(capsys, redis_url, "keys", "update", "audit-cli", "--rpm", "30", "--tpm", "900", "--json")[0] == 0
    assert llmctl(capsys, redis_url, "keys", "update", "audit-cli", "--rpm", "30", "--json")[0] == 0  # no change
    assert llmctl(capsys, redis_url, "keys", "revoke", "audit-cli", "--json")[0] == 0

    code, out = llmctl(capsys, redis_url, "audit", "--target", created["id"])
    entries = json.loads(out.out)
    assert code == 0 and [e["action"] for e in entries] == ["key.revoke", "key.update", "key.update", "key.create"]
    assert {e["actor"] for e in entries} == {llmctl_actor()} and llmctl_actor().startswith("llmctl:")
    revoke, update_none, update, create = entries
    assert revoke["before"] == {"enabled": True} and revoke["after"] == {"enabled": False}
    assert update["before"] == {"requests_per_minute": 60, "tokens_per_minute": 0}
    assert update["after"] == {"requests_per_minute": 30, "tokens_per_minute": 900}
    assert update_none["before"] == {} and update_none["after"] == {}
    assert create["before"] is None and create["after"]["name"] == "audit-cli" and "secret" not in create["after"]
    assert abs(create["at"] - time.time()) < 60 and revoke["at"] >= create["at"]
    # The secret is nowhere in the trail, nor its digest (every field of every entry is printed).
    assert created["secret"] not in out.out and digest(created["secret"]) not in out.out


async def test_admin_operations_name_the_admin_token_and_refused_changes_record_nothing(redis_url, redis):
    access = build_quota_services(
        AppSettings(redis_url=redis_url, admin_token="audit-admin-token-of-32-characters"), Telemetry(False, False)
    )
    try:
        actor = await access.authenticator.admin_actor({"authorization": "Bearer audit-admin-token-of-32-characters"})
        assert actor == ADMIN_TOKEN_ACTOR
        created = await admin.create_key(access.stores, {"name": "audit-api", "daily_token_budget": 1000}, actor)
        for refused in ({"daily_token_budget": "lots"}, {"secret": "x"}, {"requests_per_minute": -1}):
            with pytest.raises(OpenAIError) as caught:
                await admin.update_key(access.stores, created["id"], refused, actor)
            assert caught.value.status == 400
        with pytest.raises(OpenAIError):  # a name taken: 409, nothing recorded
            await admin.create_key(access.stores, {"name": "audit-api"}, actor)
        await admin.update_key(access.stores, "audit-api", {"daily_token_budget": 300, "priority": "low"}, actor)
        page = await admin.audit_trail(access.stores, 10, target=created["id"])
        assert [(e["action"], e["actor"]) for e in page["data"]] == [("key.update", actor), ("key.create", actor)]
        assert page["data"][0]["after"] == {"daily_token_budget": 300, "priority": "low"}
        assert page["has_more"] is False
    finally:
        await access.redis.aclose()


async def test_pages_newest_first_filtered_and_bad_cursors_are_400(redis_url, redis):
    log = AuditLog(redis)
    target = f"page-{time.monotonic_ns()}"
    ids = [await log.record("someone", "key.update", target, {"n": n}, {"n": n + 1}) for n in range(7)]
    await log.record("someone-else", "key.update", target)
    access = type("A", (), {"stores": type("S", (), {"audit": log})()})()
    first = await admin.audit_trail(access.stores, 3, actor="someone", target=target)
    assert [e["id"] for e in first["data"]] == ids[::-1][:3] and first["has_more"]
    second = await admin.audit_trail(access.stores, 3, before=first["data"][-1]["id"], actor="someone", target=target)
    assert [e["id"] for e in second["data"]] == ids[::-1][3:6]
    assert len((await admin.audit_trail(access.stores, 1000, target=target))["data"]) == 8
    for limit, before in ((0, None), (1001, None), ("ten", None), ([1], None), (5, "0; DROP"), (5, "+"), (5, "1-2-3")):
        with pytest.raises(OpenAIError) as caught:
            await admin.audit_trail(access.stores, limit, before=before)
        assert caught.value.status == 400


async def test_the_trail_is_bounded_in_entries_and_in_age(redis, monkeypatch):
    log = AuditLog(redis)
    monkeypatch.setattr(audit, "MAX_ENTRIES", 5)
    for n in range(12):
        await log.record("flood", "key.update", f"flood-{n}")
    assert await redis.xlen(redis_names.AUDIT_LOG) == 5
    monkeypatch.setattr(audit, "MAX_ENTRIES", 1000)
    monkeypatch.setattr(audit, "RETENTION_S", 1)
    await log.record("old", "key.update", "old")
    time.sleep(1.1)
    await log.record("new", "key.update", "new")
    remaining = [e["actor"] for e in (await log.read(100))["data"]]
    assert remaining == ["new"]


# -- named admin credentials ------------------------------------------------------


def test_llmctl_makes_a_named_admin_whose_actions_carry_its_name(capsys, redis_url):
    name = f"alice-{time.monotonic_ns()}@example.com"
    code, out = llmctl(capsys, redis_url, "admins", "create", name)
    made = json.loads(out.out)
    assert code == 0 and made["secret"].startswith("sk-admin-") and made["created_by"] == llmctl_actor()
    assert name in [a["name"] for a in json.loads(llmctl(capsys, redis_url, "admins", "list")[1].out)]
    assert "secret" not in llmctl(capsys, redis_url, "admins", "list")[1].out
    assert llmctl(capsys, redis_url, "admins", "create", name)[0] == 1  # the name is taken
    assert llmctl(capsys, redis_url, "admins", "create", "no spaces allowed")[0] == 1
    assert llmctl(capsys, redis_url, "admins", "revoke", name)[0] == 0
    assert llmctl(capsys, redis_url, "admins", "revoke", name)[0] == 1  # gone
    trail = json.loads(llmctl(capsys, redis_url, "audit", "--target", f"admin:{name}")[1].out)
    assert [e["action"] for e in trail] == ["admin.revoke", "admin.create"]
    assert made["secret"] not in json.dumps(trail)


async def test_a_named_admin_is_its_own_actor_apart_from_api_keys_and_stops_at_revocation(redis_url, redis):
    # No shared token configured: named admins still work (made by an operator with llmctl).
    access = build_quota_services(AppSettings(redis_url=redis_url), Telemetry(False, False))
    try:
        name = f"svc-{time.monotonic_ns()}"
        made = await admin.create_admin(access.stores, {"name": name}, "llmctl:root@host")
        headers = {"authorization": f"Bearer {made['secret']}"}
        actor = await access.authenticator.admin_actor(headers)
        assert actor == f"admin:{name}"
        key = await admin.create_key(access.stores, {"name": f"by-{name}"}, actor)
        [entry] = (await admin.audit_trail(access.stores, 5, target=key["id"]))["data"]
        assert entry["actor"] == f"admin:{name}"
        # An admin's secret is no API key, and an API key no admin credential.
        with pytest.raises(OpenAIError) as caught:
            await access.authenticator.authenticate(headers)
        assert caught.value.status == 401
        with pytest.raises(OpenAIError) as caught:
            await access.authenticator.admin_actor({"authorization": f"Bearer {key['secret']}"})
        assert caught.value.status == 401
        for value in ("Bearer sk-admin-", "Bearer sk-admin-" + "x" * 10_000, "Bearer sk-admin-\u00e9\x00", "Basic x"):
            with pytest.raises(OpenAIError) as caught:
                await access.authenticator.admin_actor({"authorization": value})
            assert caught.value.status == 401
        with pytest.raises(OpenAIError) as caught:  # a name that is not one
            await admin.create_admin(access.stores, {"name": "../etc"}, actor)
        assert caught.value.status == 400
        with pytest.raises(OpenAIError) as caught:
            await admin.create_admin(access.stores, {"name": name, "secret": "mine"}, actor)
        assert caught.value.status == 400
        await admin.revoke_admin(access.stores, name, actor)
        with pytest.raises(OpenAIError) as caught:  # at once: no cache holds admin credentials
            await access.authenticator.admin_actor(headers)
        assert caught.value.status == 401
        assert not await redis.exists(redis_names.admin_record(name), redis_names.admin_secret_digest(name))
    finally:
        await access.redis.aclose()


async def test_with_redis_down_a_named_admin_is_a_503_and_the_bootstrap_token_still_works():
    with running_redis(persistent=True) as server:  # its own: this test stops it
        access = build_quota_services(
            AppSettings(
                redis_url=server.url, admin_token="boot-admin-token-of-32-characters", quota={"redis_timeout_s": 1}
            ),
            Telemetry(False, False),
        )
        try:
            made = await admin.create_admin(access.stores, {"name": "ops"}, "llmctl:root@host")
            server.stop()
            try:
                with pytest.raises(OpenAIError) as caught:
                    await access.authenticator.admin_actor({"authorization": f"Bearer {made['secret']}"})
                assert (caught.value.status, caught.value.code) == (503, "quota_backend_unavailable")
                assert (
                    await access.authenticator.admin_actor(
                        {"authorization": "Bearer boot-admin-token-of-32-characters"}
                    )
                    == ADMIN_TOKEN_ACTOR
                )
            finally:
                server.start()
            await access.redis.connection_pool.disconnect()
            assert await access.authenticator.admin_actor({"authorization": f"Bearer {made['secret']}"}) == "admin:ops"
        finally:
            await access.redis.aclose()
