"""The operator console at ``/console``: server-rendered pages (no script, no build
step) over the same admin operations as the admin API and `llmctl`
(serve_app/admin/operations.py, so every change is validated and audited alike).

An operator logs in with an admin credential (a named one, or the bootstrap
``admin_token``); the console keeps a session (a random token in an HttpOnly,
SameSite=Strict cookie, its digest in Redis for ``SESSION_S``; a revoked admin's
sessions end at their next page). A form posted from another origin is refused
(the Origin header, beside SameSite). One page shows the teams, the keys (create,
revoke, change limits), usage and spend per team and model over the last 14 days
(a chart and a table), the last hour's refusals by level, and the audit trail."""

from __future__ import annotations

import html
import time
from collections import defaultdict
from typing import Any
from urllib.parse import parse_qs

from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from serve_app.accounting import usage_report
from serve_app.accounting.costs import NANOS_PER_USD
from serve_app.accounting.usage import key_usage
from serve_app.admin import operations as admin
from serve_app.admin.operations import AdminStores
from serve_app.errors import OpenAIError
from serve_app.identity.admins import SESSION_S
from serve_app.identity.authentication import Authenticator

COOKIE = "llm_console"
DAYS = 14
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
# Form fields → the admin operations' limits, and how each is read.
LIMIT_FIELDS = {
    "requests_per_minute": int,
    "tokens_per_minute": int,
    "max_concurrent": int,
    "daily_token_budget": int,
    "daily_cost_budget_usd": float,
}
e = html.escape


class Console:
    def __init__(self, authenticator: Authenticator, stores: AdminStores):
        self.authenticator, self.stores = authenticator, stores

    # -- sessions --------------------------------------------------------------

    async def session_admin(self, request: Request) -> str | None:
        """The admin whose session the request carries, or None (the ``console`` routes'
        guard asks it before their handler runs: serve_app/http/route_access.py)."""
        token = request.cookies.get(COOKIE)
        return await self.stores.admins.session_actor(token) if token else None

    async def login(self, request: Request) -> Response:
        if _from_another_site(request):  # login CSRF: a session of the attacker's admin in the victim's browser
            return _page("Refused", "<p>A form from another site was refused.</p>", status=403)
        form = await _form(request)
        credential = form.get("credential", "")
        try:  # counted against this client's failed admin credentials (credential_guard.py)
            actor = await self.authenticator.admin_actor(
                {
                    "authorization": f"Bearer {credential}",
                    "x-forwarded-for": self.authenticator.credential_guard.client(request.headers),
                }
            )
        except OpenAIError as exc:
            if exc.status == 429:
                return _page("Log in", _login_form(exc.message), status=429)
            return _page("Log in", _login_form("That is not an admin credential."), status=401)
        token = await self.stores.admins.open_session(actor)
        response = RedirectResponse("/console", status_code=303)
        response.set_cookie(COOKIE, token, max_age=SESSION_S, httponly=True, samesite="strict", path="/console")
        return response

    async def logout(self, request: Request) -> Response:
        if token := request.cookies.get(COOKIE):
            await self.stores.admins.close_session(token)
        response = RedirectResponse("/console", status_code=303)
        response.delete_cookie(COOKIE, path="/console")
        return response

    # -- pages -----------------------------------------------------------------

    async def page(self, request: Request, actor: str | None, notice: str = "", status: int = 200) -> Response:
        """The console for ``actor`` (the session's admin), or the login form for None."""
        if actor is None:
            return _page("Log in", _login_form())
        return _page("Operator console", await self._overview(actor, notice), status=status)

    async def act(self, request: Request, actor: str | None, action: str, target: str = "") -> Response:
        """A form's action (create a team or key, revoke a key, change its limits) by ``actor``
        (the session's admin; None: nothing is done)."""
        if actor is None:
            return RedirectResponse("/console", status_code=303)
        if _from_another_site(request):
            return _page("Refused", "<p>A form from another site was refused.</p>", status=403)
        form = await _form(request)
        try:
            if action == "team":
                await admin.create_team(self.stores, {"name": form.get("name", ""), **_limits(form)}, actor)
            elif action == "key":
                body = {"name": form.get("name", ""), **_limits(form)}
                if form.get("team"):
                    body["team"] = form["team"]
                created = await admin.create_key(self.stores, body, actor)
                notice = (
                    f"<div class='notice'>Key <b>{e(created['name'])}</b> created. Its secret, shown only "
                    f"now: <code id='new-secret'>{e(created['secret'])}</code></div>"
                )
                return await self.page(request, actor, notice, status=201)
            elif action == "revoke":
                await admin.revoke_key(self.stores, target, actor)
            elif action == "limits":
                await admin.update_key(self.stores, target, _limits(form), actor)
        except OpenAIError as exc:
            return await self.page(request, actor, f"<div class='error'>{e(exc.message)}</div>", status=exc.status)
        return RedirectResponse("/console", status_code=303)

    async def _overview(self, actor: str, notice: str) -> str:
        stores = self.stores
        teams, keys = await stores.teams.list(), await stores.keys.list()
        users = await stores.token_users.list()  # identity tokens' users: their usage counts alike
        accounts = [*keys, *users]
        team_names = {t.id: t.name for t in teams}
        usage = {record.id: await key_usage(stores.redis, record.id) for record in [*teams, *accounts]}
        start = int(time.time()) // 86400 * 86400 - (DAYS - 1) * 86400
        query = QueryParams({"start_time": start, "limit": DAYS, "group_by": "project_id,model"})
        daily = await usage_report.completions_usage(stores.redis, accounts, usage_report.parse_query(query))
        spent = await usage_report.costs(
            stores.redis,
            accounts,
            usage_report.parse_query(
                QueryParams({"start_time": start, "limit": DAYS, "group_by": "project_id"}), usage_report.COST_GROUPS
            ),
        )
        trail = (await stores.audit.read(20))["data"]
        return "".join(
            [
                f"<header><h1>Operator console</h1><form method='post' action='/console/logout'>"
                f"<span>{e(actor)}</span> <button>Log out</button></form></header>",
                notice,
                _section("Teams", _teams_table(teams, usage) + _team_form()),
                _section("Keys", _keys_table(keys, team_names, usage) + _key_form(teams)),
                _section("Identity-token users", _users_table(users, team_names, usage)),
                _section(
                    f"Usage, last {DAYS} days", _chart(daily, team_names) + _usage_table(daily, spent, team_names)
                ),
                _section("Refusals, last hour", _refusals_table(teams, accounts, usage)),
                _section("Audit trail", _audit_table(trail)),
            ]
        )


async def _form(request: Request) -> dict[str, str]:
    raw = await request.body()  # bounded by the route's declaration (body="form": http/body_bounds.py)
    return {name: values[0].strip() for name, values in parse_qs(raw.decode("utf-8", "replace")).items()}


def _limits(form: dict[str, str]) -> dict[str, Any]:
    limits = {}
    for name, kind in LIMIT_FIELDS.items():
        if form.get(name, "") != "":
            try:
                limits[name] = kind(form[name])
            except ValueError:
                raise OpenAIError(400, f"'{name}' must be a number, not {form[name]!r}.", param=name) from None
    return limits


# -- rendering ------------------------------------------------------------------

STYLE = """body{font:14px system-ui,sans-serif;margin:0 2em 2em;color:#222}header{display:flex;
justify-content:space-between;align-items:center}table{border-collapse:collapse;margin:.5em 0}td,th{border-bottom:
1px solid #ddd;padding:3px 8px;text-align:left}th{background:#f4f4f4}section{margin-top:1.5em}.notice{background:
#eef8ee;padding:.7em;border:1px solid #9c9}.error{background:#fbeaea;padding:.7em;border:1px solid #c99}
form.inline{display:inline}input[type=number]{width:7em}code{background:#f4f4f4;padding:2px 4px}"""


def _page(title: str, body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>",
        status_code=status,
        headers={
            "cache-control": "no-store",
            "x-frame-options": "DENY",
            "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
            "form-action 'self'; frame-ancestors 'none'",
        },
    )


def _login_form(error: str = "") -> str:
    return (
        "<h1>Operator console</h1>"
        + (f"<div class='error'>{e(error)}</div>" if error else "")
        + "<form method='post' action='/console/login'><label>Admin credential "
        "<input type='password' name='credential' id='credential' autocomplete='off'></label> "
        "<button id='login'>Log in</button></form>"
    )


def _section(title: str, body: str) -> str:
    return f"<section><h2>{e(title)}</h2>{body}</section>"


def _table(head: list[str], rows: list[list[str]], table_id: str) -> str:
    if not rows:
        return "<p>None yet.</p>"
    return (
        f"<table id='{table_id}'><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
        + "</table>"
    )


def _limits_text(record) -> str:
    parts = [
        f"{record.requests_per_minute}/min" if record.requests_per_minute else "",
        f"{record.tokens_per_minute} tok/min" if record.tokens_per_minute else "",
        f"{record.max_concurrent} at once" if record.max_concurrent else "",
        f"{record.daily_token_budget} tok/day" if record.daily_token_budget else "",
        f"${record.daily_cost_budget_usd:g}/day" if record.daily_cost_budget_usd else "",
        "models: " + ", ".join(record.models) if record.models is not None else "",
        f"prompt cache: {record.cache_isolation}" if record.cache_isolation else "",
    ]
    return e("; ".join(p for p in parts if p) or "unlimited")


def _usd(nanos: int) -> str:
    return f"${nanos / NANOS_PER_USD:,.4f}"


def _teams_table(teams, usage) -> str:
    rows = [
        [
            e(t.name),
            f"<code>{e(t.id)}</code>",
            _limits_text(t),
            e(t.priority),
            str(usage[t.id]["today"]["requests"]),
            str(usage[t.id]["today"]["tokens"]),
            _usd(usage[t.id]["today"]["cost_nanos"]),
            "yes" if t.enabled else "disabled",
        ]
        for t in teams
    ]
    return _table(
        ["Team", "Id", "Limits", "Default tier", "Requests today", "Tokens today", "Spend today", "Enabled"],
        rows,
        "teams",
    )


def _keys_table(keys, team_names, usage) -> str:
    rows = []
    for k in keys:
        actions = ""
        if k.enabled:
            actions = (
                f"<form class='inline' method='post' action='/console/keys/{e(k.id)}/limits'>"
                f"<input type='number' min='0' name='requests_per_minute' placeholder='req/min'> "
                f"<input type='number' min='0' name='tokens_per_minute' placeholder='tok/min'> "
                f"<button>Set</button></form> "
                f"<form class='inline' method='post' action='/console/keys/{e(k.id)}/revoke'>"
                f"<button id='revoke-{e(k.id)}'>Revoke</button></form>"
            )
        today = usage[k.id]["today"]
        rows.append(
            [
                e(k.name),
                f"<code>{e(k.id)}</code>",
                e(team_names.get(k.team, k.team or "")),
                _limits_text(k),
                str(today["requests"]),
                str(today["tokens"]),
                _usd(today["cost_nanos"]),
                "yes" if k.enabled else "revoked",
                actions,
            ]
        )
    return _table(
        ["Key", "Id", "Team", "Limits", "Requests today", "Tokens today", "Spend today", "Enabled", ""], rows, "keys"
    )


def _users_table(users, team_names, usage) -> str:
    """The identity provider's users the gateway admitted lately: their limits are the
    configuration's (auth.jwt.limits) and their tokens' expiry is their revocation."""
    rows = [
        [
            e(u.name),
            f"<code>{e(u.id)}</code>",
            e(team_names.get(u.team, u.team or "")),
            str(usage[u.id]["today"]["requests"]),
            str(usage[u.id]["today"]["tokens"]),
            _usd(usage[u.id]["today"]["cost_nanos"]),
        ]
        for u in users
    ]
    return _table(["User", "Id", "Team", "Requests today", "Tokens today", "Spend today"], rows, "token-users")


def _number_inputs() -> str:
    return (
        "<input type='number' min='0' name='requests_per_minute' placeholder='requests/min'> "
        "<input type='number' min='0' name='tokens_per_minute' placeholder='tokens/min'> "
        "<input type='number' min='0' name='daily_token_budget' placeholder='tokens/day'> "
        "<input type='number' min='0' step='0.01' name='daily_cost_budget_usd' placeholder='USD/day'> "
    )


def _team_form() -> str:
    return (
        "<form method='post' action='/console/teams'><b>New team</b> "
        "<input name='name' id='team-name' placeholder='name' required> "
        + _number_inputs()
        + "<button id='create-team'>Create team</button></form>"
    )


def _key_form(teams) -> str:
    options = "<option value=''>(no team)</option>" + "".join(
        f"<option value='{e(t.id)}'>{e(t.name)}</option>" for t in teams if t.enabled
    )
    return (
        "<form method='post' action='/console/keys'><b>New key</b> "
        "<input name='name' id='key-name' placeholder='name' required> "
        f"<select name='team' id='key-team'>{options}</select> "
        + _number_inputs()
        + "<button id='create-key'>Create key</button></form>"
    )


def _chart(daily: dict, team_names: dict) -> str:
    """Tokens per day, a bar per day stacked by team (inline SVG)."""
    days = daily["data"]
    per_day: list[defaultdict[str, int]] = [defaultdict(int) for _ in days]
    teams: list[str] = []
    for i, bucket in enumerate(days):
        for result in bucket["results"]:
            team = team_names.get(result["project_id"], result["project_id"] or "(no team)")
            per_day[i][team] += result["input_tokens"] + result["output_tokens"] + result["reserved_tokens"]
            if team not in teams:
                teams.append(team)
    top = max([sum(d.values()) for d in per_day] + [1])
    width, height, bar = 40 * len(days) + 60, 180, 28
    parts = [
        f"<svg id='usage-chart' width='{width}' height='{height + 40}' role='img' aria-label='tokens per day by team'>",
        f"<text x='0' y='12' font-size='11'>{top:,} tokens</text>",
    ]
    for i, day in enumerate(per_day):
        y = height + 16
        for team in teams:
            # At least a pixel for any use: a small team beside a big one stays visible (and hoverable).
            h = max(1, round(day[team] / top * height)) if day[team] else 0
            if h:
                y -= h
                color = PALETTE[teams.index(team) % len(PALETTE)]
                parts.append(
                    f"<rect x='{50 + 40 * i}' y='{y}' width='{bar}' height='{h}' fill='{color}'>"
                    f"<title>{e(team)}: {day[team]:,}</title></rect>"
                )
        label = time.strftime("%m-%d", time.gmtime(days[i]["start_time"]))
        parts.append(f"<text x='{50 + 40 * i}' y='{height + 32}' font-size='10'>{label}</text>")
    parts.append("</svg>")
    legend = " ".join(
        f"<span style='color:{PALETTE[i % len(PALETTE)]}'>&#9632;</span> {e(t)}" for i, t in enumerate(teams)
    )
    return "".join(parts) + f"<div>{legend}</div>"


def _usage_table(daily: dict, spent: dict, team_names: dict) -> str:
    """Requests, tokens and the prompt cache's hit rate (the prompt tokens the engines
    served from the team's own cache: cache_isolation's cost to it) per team and model."""
    totals: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for bucket in daily["data"]:
        for r in bucket["results"]:
            row = totals[(r["project_id"], r["model"])]
            row[0] += r["num_model_requests"]
            row[1] += r["input_tokens"] + r["output_tokens"] + r["reserved_tokens"]
            row[2] += r["input_tokens"]
            row[3] += r["input_cached_tokens"]
    money: dict[str | None, float] = defaultdict(float)
    for bucket in spent["data"]:
        for r in bucket["results"]:
            money[r["project_id"]] += r["amount"]["value"]
    rows = [
        [
            e(team_names.get(team, team or "(no team)")),
            e(model or ""),
            str(n),
            f"{tokens:,}",
            f"{cached / prompt:.0%}" if prompt else "-",
        ]
        for (team, model), (n, tokens, prompt, cached) in sorted(
            totals.items(), key=lambda i: (i[0][0] or "", i[0][1] or "")
        )
    ]
    spend = [
        [e(team_names.get(team, team or "(no team)")), f"${usd:,.4f}"]
        for team, usd in sorted(money.items(), key=lambda i: i[0] or "")
    ]
    return _table(["Team", "Model", "Requests", "Tokens", "Prompt cache hits"], rows, "usage") + _table(
        ["Team", f"Spend, {DAYS} days"], spend, "spend"
    )


def _refusals_table(teams, keys, usage) -> str:
    rows = []
    for level, records in (("team", teams), ("key", keys)):
        for record in records:
            for kind, count in sorted(usage[record.id]["refused_last_hour"].items()):
                rows.append([level, e(record.name), e(kind), str(count)])
    return _table(["Level", "Name", "Limit", "Refused"], rows, "refusals")


def _audit_table(trail: list[dict]) -> str:
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry["at"]))
            if isinstance(entry.get("at"), (int, float))
            else e(str(entry.get("at", ""))),
            e(entry["actor"]),
            e(entry["action"]),
            f"<code>{e(entry['target'])}</code>",
            e(str(entry.get("after") or entry.get("before") or "")),
        ]
        for entry in trail
    ]
    return _table(["When", "Who", "What", "Target", "Change"], rows, "audit")


def _from_another_site(request: Request) -> bool:
    """A form posted by a page of another origin (the Origin header browsers send
    with every POST), beside the session cookie's SameSite=Strict."""
    origin = request.headers.get("origin")
    return origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}"
