"""The operator console's pages (server-rendered: serve_app/http/console.py). Every
route is ``console``: its guard reads the session before the handler runs (``admin_of``:
None without one, whose pages offer the login form and act on nothing)."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import Response

from serve_app.http.route_access import session_admin_of
from serve_app.http.routes.table import IngressRoutes, route


class ConsoleRoutes(IngressRoutes):
    """The console's pages and forms."""

    @route("GET", "/console", "console")
    async def console_page(self, request: Request) -> Response:
        return await self.console.page(request, session_admin_of(request))

    @route("POST", "/console/login", "console", body="form")
    async def console_login(self, request: Request) -> Response:
        return await self.console.login(request)

    @route("POST", "/console/logout", "console", body="form")
    async def console_logout(self, request: Request) -> Response:
        return await self.console.logout(request)

    @route("POST", "/console/teams", "console", body="form")
    async def console_create_team(self, request: Request) -> Response:
        return await self.console.act(request, session_admin_of(request), "team")

    @route("POST", "/console/keys", "console", body="form")
    async def console_create_key(self, request: Request) -> Response:
        return await self.console.act(request, session_admin_of(request), "key")

    @route("POST", "/console/keys/{key}/revoke", "console", body="form")
    async def console_revoke_key(self, key: str, request: Request) -> Response:
        return await self.console.act(request, session_admin_of(request), "revoke", key)

    @route("POST", "/console/keys/{key}/limits", "console", body="form")
    async def console_key_limits(self, key: str, request: Request) -> Response:
        return await self.console.act(request, session_admin_of(request), "limits", key)
