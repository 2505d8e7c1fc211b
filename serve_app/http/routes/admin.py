"""The admin API (the same operations as `llmctl`: serve_app/admin/operations.py) and
OpenAI's organization Usage and Costs API. Every route is ``admin``: its guard checks the
admin credential before the handler runs and hands it the actor (``admin_of``), whom the
audit trail names."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse

from serve_app.admin import operations as admin
from serve_app.http.route_access import admin_of
from serve_app.http.routes.table import IngressRoutes, route
from serve_app.wire.api_requests import list_params, parse_json_object


class AdminRoutes(IngressRoutes):
    """Keys, teams, admins, requests, batches, the audit trail; usage and costs."""

    async def _admin_json(self, request: Request) -> tuple[str, Any]:
        """(the admin calling, the request's JSON object)."""
        raw = await self._read_body(request)
        return admin_of(request), parse_json_object(raw) if raw else {}

    @route("POST", "/admin/keys", "admin")
    async def admin_create_key(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_key(self.admin_stores, body, actor), status_code=201)

    @route("GET", "/admin/keys", "admin")
    async def admin_list_keys(self, request: Request) -> JSONResponse:
        return JSONResponse(await admin.list_keys(self.admin_stores))

    @route("GET", "/admin/keys/{key}", "admin")
    async def admin_show_key(self, key: str, request: Request) -> JSONResponse:
        return JSONResponse(await admin.show_key(self.admin_stores, key))

    @route("PATCH", "/admin/keys/{key}", "admin")
    async def admin_update_key(self, key: str, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.update_key(self.admin_stores, key, body, actor))

    @route("DELETE", "/admin/keys/{key}", "admin")
    async def admin_revoke_key(self, key: str, request: Request) -> JSONResponse:
        actor = admin_of(request)
        return JSONResponse(await admin.revoke_key(self.admin_stores, key, actor))

    @route("GET", "/admin/keys/{key}/usage", "admin")
    async def admin_key_usage(self, key: str, request: Request) -> JSONResponse:
        return JSONResponse(await admin.usage(self.admin_stores, key))

    @route("POST", "/admin/teams", "admin")
    async def admin_create_team(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_team(self.admin_stores, body, actor), status_code=201)

    @route("GET", "/admin/teams", "admin")
    async def admin_list_teams(self, request: Request) -> JSONResponse:
        return JSONResponse(await admin.list_teams(self.admin_stores))

    @route("GET", "/admin/teams/{team}", "admin")
    async def admin_show_team(self, team: str, request: Request) -> JSONResponse:
        return JSONResponse(await admin.show_team(self.admin_stores, team))

    @route("PATCH", "/admin/teams/{team}", "admin")
    async def admin_update_team(self, team: str, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.update_team(self.admin_stores, team, body, actor))

    @route("DELETE", "/admin/teams/{team}", "admin")
    async def admin_revoke_team(self, team: str, request: Request) -> JSONResponse:
        actor = admin_of(request)
        return JSONResponse(await admin.revoke_team(self.admin_stores, team, actor))

    @route("GET", "/v1/organization/usage/completions", "admin")
    async def organization_usage_completions(self, request: Request) -> JSONResponse:
        """OpenAI's organization Usage API (an admin credential, as OpenAI's needs an
        admin key): per day, by key and model (serve_app/accounting/usage_report.py)."""
        return JSONResponse(await admin.completions_usage(self.admin_stores, request.query_params))

    @route("GET", "/v1/organization/costs", "admin")
    async def organization_costs(self, request: Request) -> JSONResponse:
        """OpenAI's organization Costs API: per day, by key and line item ("<model>, input")."""
        return JSONResponse(await admin.costs(self.admin_stores, request.query_params))

    @route("GET", "/admin/requests/{request_id}", "admin")
    async def admin_request(self, request_id: str, request: Request) -> JSONResponse:
        return JSONResponse(await admin.request(self.admin_stores, request_id, request.query_params.get("key")))

    @route("GET", "/admin/batches", "admin")
    async def admin_list_batches(self, request: Request) -> JSONResponse:
        params = list_params(request.query_params)
        return JSONResponse(
            await admin.list_batches(
                self.admin_stores, self.batches, request.query_params.get("key"), params["limit"], params["after"]
            )
        )

    @route("POST", "/admin/batches/{batch_id}/cancel", "admin")
    async def admin_cancel_batch(self, batch_id: str, request: Request) -> JSONResponse:
        actor = admin_of(request)
        return JSONResponse(await admin.cancel_batch(self.admin_stores, self.batches, batch_id, actor))

    @route("POST", "/admin/admins", "admin")
    async def admin_create_admin(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_admin(self.admin_stores, body, actor), status_code=201)

    @route("GET", "/admin/admins", "admin")
    async def admin_list_admins(self, request: Request) -> JSONResponse:
        return JSONResponse(await admin.list_admins(self.admin_stores))

    @route("DELETE", "/admin/admins/{name}", "admin")
    async def admin_revoke_admin(self, name: str, request: Request) -> JSONResponse:
        actor = admin_of(request)
        return JSONResponse(await admin.revoke_admin(self.admin_stores, name, actor))

    @route("GET", "/admin/audit", "admin")
    async def admin_audit(self, request: Request) -> JSONResponse:
        """Admin actions, newest first: ``limit`` (1-1000), ``before`` (an entry id: the
        next page), ``actor``, ``target`` (a key id, a batch id)."""
        query = request.query_params
        return JSONResponse(
            await admin.audit_trail(
                self.admin_stores, query.get("limit", 100), query.get("before"), query.get("actor"), query.get("target")
            )
        )
