"""`llmctl` against a real Redis."""

import json

from serve_app.cli import main


def run(capsys, redis_url, *argv):
    code = main(["--redis-url", redis_url, *argv])
    out = capsys.readouterr().out
    return code, out


def test_key_lifecycle(capsys, redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    code, out = run(capsys, redis_url, "keys", "create", "cli-team", "--rpm", "60", "--models", "a,b",
                    "--priority", "low", "--json")
    created = json.loads(out)
    assert code == 0 and created["secret"].startswith("sk-llm-")
    assert created["requests_per_minute"] == 60 and created["models"] == ["a", "b"] and created["priority"] == "low"

    code, out = run(capsys, redis_url, "keys", "show", "cli-team", "--json")
    shown = json.loads(out)
    assert "secret" not in shown and shown["id"] == created["id"]

    code, out = run(capsys, redis_url, "keys", "update", created["id"], "--tpm", "500", "--models", "*",
                    "--priority", "high", "--json")
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
