"""``llmctl``: the operator's command line.

    llmctl keys create NAME [--rpm N --tpm N --max-concurrent N --daily-tokens N
                             --monthly-tokens N --models a,b --priority high|normal|low
                             --cache-isolation key|team|shared|model] [--json]
    llmctl keys list|show|update|revoke ...
    llmctl usage --key NAME_OR_ID | [--key K] --days N [--by api_key_id,model] [--csv]
    llmctl requests show REQUEST_ID [--key NAME_OR_ID]
    llmctl batches list [--key NAME_OR_ID] | cancel BATCH_ID   (any key's batches)
    llmctl admins create NAME | list | revoke NAME   (named admin credentials; the secret is shown once)
    llmctl audit [--limit N --before ID --actor WHO --target KEY_OR_BATCH_ID]   (admin actions, newest first)
    llmctl check-config FILE | demo-model
    llmctl run [CONFIG] [--grace S] [--log FILE] | stop   (the local stack: `make run`, `make stop`)
    llmctl status [--json]     (replicas by state and target, engine load, Redis, keys)

Redis is the one named by REDIS_URL (or --redis-url).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
from pathlib import Path
from typing import get_args

from contract.model_config import PRIORITY_TIERS, CacheIsolation

LIMIT_FLAGS = {
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "max_concurrent": "max_concurrent",
    "daily_tokens": "daily_token_budget",
    "monthly_tokens": "monthly_token_budget",
}
MONEY_FLAGS = {"daily_usd": "daily_cost_budget_usd", "monthly_usd": "monthly_cost_budget_usd"}


def _limit_changes(args: argparse.Namespace) -> dict:
    changes = {
        field: getattr(args, flag)
        for flag, field in {**LIMIT_FLAGS, **MONEY_FLAGS}.items()
        if getattr(args, flag) is not None
    }
    if getattr(args, "team", None) is not None:
        changes["team"] = args.team
    if args.models is not None:
        changes["models"] = None if args.models in ("", "*") else args.models.split(",")
    if args.priority is not None:
        changes["priority"] = args.priority
    if args.cache_isolation is not None:
        changes["cache_isolation"] = None if args.cache_isolation == "model" else args.cache_isolation
    return changes


def _print(value, as_json: bool) -> None:
    if as_json:
        print(json.dumps(value, indent=2, sort_keys=True))
        return
    rows = value if isinstance(value, list) else [value]
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))


def _admin_access(redis):
    """The stores admin/operations.py works on, for `llmctl`'s admin actions."""
    from serve_app.admin.operations import AdminStores

    return AdminStores.over(redis)


async def _admin_command(args: argparse.Namespace, work) -> int:
    """``await work(access, actor)``, an admin operation of admin/operations.py (validated
    and audited as through the admin API); its refusal is printed, exit status 1."""
    from serve_app.accounting.audit import llmctl_actor
    from serve_app.errors import OpenAIError

    redis = _redis(args)
    try:
        await work(_admin_access(redis), llmctl_actor())
        return 0
    except OpenAIError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    finally:
        await redis.aclose()


async def _keys(args: argparse.Namespace) -> int:
    from serve_app.admin import operations as admin

    async def work(access, actor) -> None:
        if args.action == "create":
            _print(await admin.create_key(access, {"name": args.name, **_limit_changes(args)}, actor), args.json)
            if not args.json:
                print("The secret is shown only now; store it safely.", file=sys.stderr)
        elif args.action == "list":
            _print((await admin.list_keys(access))["data"], args.json)
        elif args.action == "show":
            _print(await admin.show_key(access, args.key), args.json)
        elif args.action == "update":
            changes = _limit_changes(args)
            if args.enable is not None:
                changes["enabled"] = args.enable
            _print(await admin.update_key(access, args.key, changes, actor), args.json)
        elif args.action == "revoke":
            _print(await admin.revoke_key(access, args.key, actor), args.json)
        elif args.action == "ensure-dev":
            print(await _ensure_dev_key(access, actor))

    return await _admin_command(args, work)


async def _teams(args: argparse.Namespace) -> int:
    from serve_app.admin import operations as admin

    async def work(access, actor) -> None:
        if args.action == "create":
            _print(await admin.create_team(access, {"name": args.name, **_limit_changes(args)}, actor), args.json)
        elif args.action == "list":
            _print((await admin.list_teams(access))["data"], args.json)
        elif args.action == "show":
            _print(await admin.show_team(access, args.which), True)
        elif args.action == "update":
            changes = _limit_changes(args)
            if args.enable is not None:
                changes["enabled"] = args.enable
            _print(await admin.update_team(access, args.which, changes, actor), args.json)
        elif args.action == "revoke":
            _print(await admin.revoke_team(access, args.which, actor), args.json)

    return await _admin_command(args, work)


async def _ensure_dev_key(access, actor: str) -> str:
    """The local development key: its secret lives in a 0600 file under the
    data directory so `make run` can print it on every start."""
    from replicas.demo_model import data_dir

    path = data_dir() / "dev-api-key"
    secret = path.read_text().strip() if path.exists() else None
    if secret and await access.keys.authenticate(secret):
        return secret
    from serve_app.identity.keys import new_secret

    secret = new_secret()
    name = "dev"
    for attempt in range(100):
        try:
            record, _ = await access.keys.create(name if attempt == 0 else f"dev-{attempt}", secret=secret)
            break
        except ValueError:  # the name is taken by an older dev key
            continue
    await access.audit.record(actor, "key.create", record.id, after=record.model_dump())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(secret + "\n")
    return secret


async def _usage(args: argparse.Namespace) -> int:
    """A key's today and month (``--key`` alone), or the usage report: the last
    ``--days`` days by key and model, as OpenAI's usage API serves it, or as CSV."""
    import time

    from starlette.datastructures import QueryParams

    from serve_app.admin import operations as admin

    async def work(access, actor) -> None:
        key = await admin.account(access, args.key) if args.key else None  # a stored key or a token's user
        team = await admin.show_team(access, args.team) if args.team else None
        if key is not None and args.days is None and not args.csv:
            _print(await admin.usage(access, key["id"]), True)
            return
        if team is not None and args.days is None and not args.csv:
            _print({"team": team["name"], "id": team["id"], "keys": team["keys"], **team["usage"]}, True)
            return
        today = int(time.time()) // 86400 * 86400
        params = QueryParams(
            {
                "start_time": today - ((args.days or 7) - 1) * 86400,
                "limit": args.days or 7,
                "group_by": args.by,
                **({"api_key_ids": key["id"]} if key else {}),
                **({"project_ids": team["id"]} if team else {}),
            }
        )
        page = await admin.completions_usage(access, params)
        if not args.csv:
            _print(page, True)
            return
        names = {k.id: k.name for k in await admin.accounts(access)}
        teams = {t["id"]: t["name"] for t in (await admin.list_teams(access))["data"]}
        columns = (
            "date",
            "team",
            "api_key_id",
            "key_name",
            "model",
            "num_model_requests",
            "input_tokens",
            "output_tokens",
            "reserved_tokens",
        )
        out = csv.writer(sys.stdout)
        out.writerow(columns)
        for bucket in page["data"]:
            date = time.strftime("%Y-%m-%d", time.gmtime(bucket["start_time"]))
            for result in bucket["results"]:
                out.writerow(
                    [
                        date,
                        teams.get(result["project_id"], ""),
                        result["api_key_id"] or "",
                        names.get(result["api_key_id"], ""),
                        result["model"] or "",
                        *(result[c] for c in columns[5:]),
                    ]
                )

    return await _admin_command(args, work)


def _default_records_dir() -> str:
    from serve_app.settings import RecordsConfig

    return os.environ.get("LLM_CLUSTER_RECORDS__SINK_DIR", RecordsConfig().sink_dir or "")


async def _request(args: argparse.Namespace) -> int:
    from serve_app.accounting.record_sink import RecordSink
    from serve_app.accounting.usage import request_state
    from serve_app.identity.keys import KeyNotFound, KeyStore

    redis = _redis(args)
    sink = RecordSink(args.records_dir, retention_s=0) if args.records_dir else None  # retention: never swept here
    try:
        key_id = (await KeyStore(redis).resolve(args.key)).id if args.key else None
        state = await request_state(redis, args.request_id, key_id, sink)
    except (ValueError, KeyNotFound) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        await redis.aclose()
    if state is None:
        print(f"no record of request {args.request_id} (unknown or past retention)", file=sys.stderr)
        return 1
    _print(state, True)
    return 0


async def _batches(args: argparse.Namespace) -> int:
    from serve_app.admin import operations as admin
    from serve_app.stored.batches import BatchStore

    async def work(access, actor) -> None:
        batches = BatchStore(access.redis, files=None, max_requests=0)  # listing and cancelling read no file
        if args.action == "list":
            _print((await admin.list_batches(access, batches, args.key, limit=100, after=None))["data"], True)
        else:
            _print(await admin.cancel_batch(access, batches, args.batch_id, actor), True)

    return await _admin_command(args, work)


async def _admins(args: argparse.Namespace) -> int:
    from serve_app.admin import operations as admin

    async def work(access, actor) -> None:
        if args.action == "create":
            _print(await admin.create_admin(access, {"name": args.name}, actor), True)
            print("The secret is shown only now; give it to its owner safely.", file=sys.stderr)
        elif args.action == "list":
            _print((await admin.list_admins(access))["data"], True)
        else:
            _print(await admin.revoke_admin(access, args.name, actor), True)

    return await _admin_command(args, work)


async def _audit(args: argparse.Namespace) -> int:
    from serve_app.admin import operations as admin

    async def work(access, actor) -> None:
        page = await admin.audit_trail(access, args.limit, args.before, args.actor, args.target)
        _print(page["data"], True)
        if page["has_more"]:
            print(f"older entries: llmctl audit --before {page['data'][-1]['id']}", file=sys.stderr)

    return await _admin_command(args, work)


def _redis(args: argparse.Namespace):
    from serve_app.redis_store import redis_client

    return redis_client.connect(args.redis_url)


def _check_config(path: Path) -> int:
    """Validate every application's args in a Serve config against AppSettings, and
    that each direct route has its application (what `serve deploy` does not add)."""
    import yaml

    from serve_app.app import direct_route_problems
    from serve_app.settings import AppSettings

    config = yaml.safe_load(path.read_text())
    for application in config.get("applications", []):
        args = dict(application.get("args") or {})
        args.pop("direct_model", None)  # a direct route's: the rest is its main application's (serve_app/app.py)
        settings = AppSettings(**args)
        print(json.dumps({"application": application.get("name"), "models": [m.name for m in settings.models]}))
    problems = direct_route_problems(config)
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _demo_model(_: argparse.Namespace) -> int:
    from replicas.demo_model import build_demo_model

    print(build_demo_model())
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from serve_app.ops import local_stack

    grace_s = local_stack.DEFAULT_GRACE_S if args.grace is None else args.grace
    verbose = os.environ.get("VERBOSE", "") not in ("", "0")
    return local_stack.run(args.config, grace_s, log=args.log, verbose=verbose)


def _stop_local(_: argparse.Namespace) -> int:
    from serve_app.ops.local_stack import request_stop

    return request_stop()


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for flag in LIMIT_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, default=None)
    for flag in MONEY_FLAGS:
        parser.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=float,
            default=None,
            help="spend budget in USD at the models' prices",
        )
    parser.add_argument("--models", default=None, help="comma-separated model names; '*' = all")
    parser.add_argument(
        "--priority", default=None, choices=PRIORITY_TIERS, help="scheduling tier under load (default normal)"
    )
    parser.add_argument(
        "--cache-isolation",
        default=None,
        choices=(*get_args(CacheIsolation), "model"),
        help="whose requests share the prompt cache with this one's: key, team, shared; "
        "'model' (the default): the team's, else the model's setting",
    )


def _status(args: argparse.Namespace) -> int:
    from serve_app.ops import status

    serve_part = status.serve_status(args.app)
    redis_part = asyncio.run(status.redis_status(args.redis_url))
    if args.json:
        _print({"serve": serve_part, "redis": redis_part}, True)
    else:
        print(status.render(serve_part, redis_part, args.redis_url))
    return 0 if "error" not in serve_part and redis_part["reachable"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    commands = parser.add_subparsers(dest="command", required=True)

    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(dest="action", required=True)
    create = keys.add_parser("create", help="create a key; prints its secret once")
    create.add_argument("name")
    _add_limit_flags(create)
    create.add_argument("--team", default=None, help="the team (id or name) the key belongs to")
    keys.add_parser("list")
    for action in ("show", "revoke"):
        keys.add_parser(action).add_argument("key", help="key id or name")
    update = keys.add_parser("update")
    update.add_argument("key", help="key id or name")
    _add_limit_flags(update)
    update.add_argument("--team", default=None, help="move the key to this team (id or name)")
    update.add_argument("--enable", dest="enable", action="store_true", default=None)
    update.add_argument("--disable", dest="enable", action="store_false")
    keys.add_parser("ensure-dev", help="make sure the local development key exists; print its secret")
    for sub in keys.choices.values():
        sub.add_argument("--json", action="store_true")
    commands.choices["keys"].set_defaults(run=lambda a: asyncio.run(_keys(a)))

    teams = commands.add_parser("teams", help="manage teams (limits over their keys)").add_subparsers(
        dest="action", required=True
    )
    _add_limit_flags(teams_create := teams.add_parser("create", help="create a team"))
    teams_create.add_argument("name")
    teams.add_parser("list")
    for action in ("show", "revoke"):
        teams.add_parser(action).add_argument("which", metavar="team", help="team id or name")
    teams_update = teams.add_parser("update")
    teams_update.add_argument("which", metavar="team", help="team id or name")
    _add_limit_flags(teams_update)
    teams_update.add_argument("--enable", dest="enable", action="store_true", default=None)
    teams_update.add_argument("--disable", dest="enable", action="store_false")
    for sub in teams.choices.values():
        sub.add_argument("--json", action="store_true")
    commands.choices["teams"].set_defaults(run=lambda a: asyncio.run(_teams(a)))

    usage = commands.add_parser("usage", help="a key's usage today and this month, or the usage report by day")
    usage.add_argument("--key", default=None, help="key id or name (alone: its today and month)")
    usage.add_argument("--days", type=int, default=None, help="the report: the last N days (UTC), 1-31")
    usage.add_argument(
        "--team",
        default=None,
        help="team id or name (alone: its today and month; with --days or --csv: the report of its keys)",
    )
    usage.add_argument(
        "--by",
        default="project_id,api_key_id,model",
        help="the report's grouping: any of project_id (the team), api_key_id, model",
    )
    usage.add_argument("--csv", action="store_true", help="the report as CSV, a row per day, key and model")
    usage.set_defaults(run=lambda a: asyncio.run(_usage(a)))

    requests = commands.add_parser("requests", help="request records").add_subparsers(dest="action", required=True)
    show = requests.add_parser("show", help="by request id, completion id or x-request-id")
    show.add_argument("request_id")
    show.add_argument("--key", default=None, help="look an x-request-id up among this key's requests (id or name)")
    show.add_argument(
        "--records-dir",
        default=_default_records_dir(),
        help="the record sink (records.sink_dir), read for records no longer in Redis; "
        "'' for Redis only (default: $LLM_CLUSTER_RECORDS__SINK_DIR or the config default)",
    )
    commands.choices["requests"].set_defaults(run=lambda a: asyncio.run(_request(a)))

    batches = commands.add_parser("batches", help="any key's batches").add_subparsers(dest="action", required=True)
    listing = batches.add_parser("list", help="every batch not ended yet, or one key's batches (newest 100)")
    listing.add_argument("--key", default=None, help="key id or name")
    batches.add_parser("cancel", help="cancel a batch not ended yet").add_argument("batch_id")
    commands.choices["batches"].set_defaults(run=lambda a: asyncio.run(_batches(a)))

    admins = commands.add_parser("admins", help="named admin credentials").add_subparsers(dest="action", required=True)
    admins.add_parser("create", help="a new admin credential; prints its secret once").add_argument("name")
    admins.add_parser("list")
    admins.add_parser("revoke", help="the credential stops working at once").add_argument("name")
    commands.choices["admins"].set_defaults(run=lambda a: asyncio.run(_admins(a)))

    audit = commands.add_parser("audit", help="admin actions (keys, limits, revocations, batch cancels), newest first")
    audit.add_argument("--limit", type=int, default=50)
    audit.add_argument("--before", default=None, help="an entry id: the entries older than it")
    audit.add_argument("--actor", default=None, help="only this actor's (e.g. admin-token, llmctl:alice@host)")
    audit.add_argument("--target", default=None, help="only those on this key id or batch id")
    audit.set_defaults(run=lambda a: asyncio.run(_audit(a)))

    check = commands.add_parser("check-config", help="validate a Serve config file")
    check.add_argument("path", type=Path)
    check.set_defaults(run=lambda a: _check_config(a.path))
    commands.add_parser("demo-model", help="build the tiny demo model; print its path").set_defaults(run=_demo_model)

    run = commands.add_parser("run", help="serve a config on a local Ray instance until Ctrl-C or `llmctl stop`")
    run.add_argument("config", type=Path, nargs="?", default=Path("configs/local.yaml"))
    run.add_argument("--grace", type=float, default=None, help="seconds requests in flight get when stopping")
    run.add_argument(
        "--log",
        type=Path,
        default=None,
        help="where Ray's and vLLM's output goes (default: the data dir's logs/run.log; VERBOSE=1: the terminal)",
    )
    run.set_defaults(run=_run_local)
    commands.add_parser("stop", help="stop the stack `llmctl run` started").set_defaults(run=_stop_local)
    status = commands.add_parser("status", help="models, replicas, engine load, Redis: what runs here")
    status.add_argument("--app", default="llm", help="the Serve application's name")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
