"""`llmctl` against a real Redis."""

import json

from serve_app.cli import main


def run(capsys, redis_url, *argv):
    code = main(["--redis-url", redis_url, *argv])
    out = capsys.readouterr().out
    return code, out


def test_key_lifecycle(capsys, redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    code, out = run(
        capsys, redis_url, "keys", "create", "cli-team", "--rpm", "60", "--models", "a,b", "--priority", "low", "--json"
    )
    created = json.loads(out)
    assert code == 0 and created["secret"].startswith("sk-llm-")
    assert created["requests_per_minute"] == 60 and created["models"] == ["a", "b"] and created["priority"] == "low"

    code, out = run(capsys, redis_url, "keys", "show", "cli-team", "--json")
    shown = json.loads(out)
    assert "secret" not in shown and shown["id"] == created["id"]

    code, out = run(
        capsys,
        redis_url,
        "keys",
        "update",
        created["id"],
        "--tpm",
        "500",
        "--models",
        "*",
        "--priority",
        "high",
        "--json",
    )
    updated = json.loads(out)
    assert updated["tokens_per_minute"] == 500 and updated["models"] is None and updated["priority"] == "high"

    code, out = run(capsys, redis_url, "keys", "list", "--json")
    assert "cli-team" in [k["name"] for k in json.loads(out)]

    code, out = run(capsys, redis_url, "keys", "revoke", "cli-team", "--json")
    assert json.loads(out)["enabled"] is False

    code, out = run(capsys, redis_url, "usage", "--key", "cli-team")
    assert json.loads(out)["today"]["requests"] == 0

    assert run(capsys, redis_url, "keys", "show", "nobody")[0] == 1
    assert run(capsys, redis_url, "requests", "show", "chatcmpl-knope-123")[0] == 1


def test_dev_key_is_stable_across_calls(capsys, redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    first = run(capsys, redis_url, "keys", "ensure-dev")[1].strip()
    second = run(capsys, redis_url, "keys", "ensure-dev")[1].strip()
    assert first == second and first.startswith("sk-llm-")
    assert (tmp_path / "dev-api-key").stat().st_mode & 0o777 == 0o600


def test_team_lifecycle_and_its_usage(capsys, redis_url):
    import asyncio
    import csv
    import io

    from serve_app.http.services import build_quota_services
    from serve_app.settings import AppSettings
    from serve_app.telemetry import Telemetry

    code, out = run(
        capsys,
        redis_url,
        "teams",
        "create",
        "cli-eng",
        "--rpm",
        "100",
        "--daily-usd",
        "2.5",
        "--priority",
        "high",
        "--json",
    )
    team = json.loads(out)
    assert code == 0 and team["id"].startswith("t") and team["daily_cost_budget_usd"] == 2.5
    code, out = run(capsys, redis_url, "keys", "create", "cli-eng-key", "--team", "cli-eng", "--json")
    key = json.loads(out)
    assert key["team"] == team["id"] and key["priority"] == "high"  # the team's tier
    code, out = run(capsys, redis_url, "teams", "update", "cli-eng", "--tpm", "5000", "--json")
    assert json.loads(out)["tokens_per_minute"] == 5000
    assert "cli-eng" in [t["name"] for t in json.loads(run(capsys, redis_url, "teams", "list", "--json")[1])]

    async def one_request():  # charged to the key and its team, as the ingress would
        access = build_quota_services(AppSettings(redis_url=redis_url), Telemetry(False, False))
        try:
            ticket = await access.gate.admit(await access.stores.keys.get(key["id"]), "chat", 10)
            await access.gate.admission.settle(ticket.key, ticket.request_id, "completed", 3, 4, "", "chat")
            await access.gate.admission.settle(ticket.team, ticket.request_id, "completed", 3, 4, "", "chat")
        finally:
            await access.redis.aclose()

    asyncio.run(one_request())
    code, out = run(capsys, redis_url, "usage", "--team", "cli-eng")
    assert code == 0 and json.loads(out)["today"]["requests"] == 1 and json.loads(out)["keys"] == [key["id"]]
    code, out = run(capsys, redis_url, "usage", "--team", "cli-eng", "--days", "1", "--csv")
    [row] = list(csv.DictReader(io.StringIO(out)))
    assert (row["team"], row["key_name"], row["model"], row["input_tokens"]) == ("cli-eng", "cli-eng-key", "chat", "3")

    code, out = run(capsys, redis_url, "teams", "revoke", "cli-eng", "--json")
    assert json.loads(out)["enabled"] is False
    assert run(capsys, redis_url, "keys", "create", "orphan", "--team", "no-such-team")[0] == 1
