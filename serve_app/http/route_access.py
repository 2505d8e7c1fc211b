"""Who may call each route, declared with the route, and enforced by that declaration.

``Routes(app)`` is a route decorator that takes, beside the method and path, who may
call the route, and wraps the handler in that access's guard, so a route cannot be
declared without its check and a handler cannot skip it:

- ``probe``: anyone (liveness, readiness); names no model, carries no tenant's data.
- ``key``: an API key or an identity token, and only for models the key may use. The
  handler authenticates (``Authenticator.authenticate`` or ``tenant``: where the 401 is
  rendered in its dialect's envelope and traced); the guard refuses to let a successful
  answer out of a route whose handler did not (a 500, logged: a bug, never data).
- ``admin``: an admin credential (the bootstrap token or a named admin). The guard checks
  it before the handler runs and hands the handler its actor (``admin_of(request)``).
- ``console``: the operator console's session (an admin credential given at
  ``/console/login``). The guard reads the session before the handler runs and hands it
  its actor (``admin_of(request)``: None without a session, whose pages then offer the
  login form and act on nothing).

The table of every route's access (``Routes.access``) drives the tests that call every
route with every kind of credential (tests/e2e/quota_stack/test_1_route_access_e2e.py), so
a route added without a test of its access cannot be missed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from starlette.responses import Response

from serve_app.errors import OpenAIError
from serve_app.http.body_bounds import BodyKind, bounded_route
from serve_app.identity.authentication import credential_checked, reset_credential_checked, start_credential_check

logger = logging.getLogger("ray.serve")

RouteAccess = Literal["probe", "key", "admin", "console"]
KINDS: tuple[RouteAccess, ...] = ("probe", "key", "admin", "console")


def admin_of(request: Request) -> str:
    """The admin an ``admin`` route's guard authenticated."""
    admin: str | None = request.state.admin
    if admin is None:
        raise RuntimeError("not an admin route: its guard authenticated no admin")
    return admin


def session_admin_of(request: Request) -> str | None:
    """The admin whose session a ``console`` route's guard found (None: no session)."""
    admin: str | None = request.state.admin
    return admin


class Routes:
    """Route decorators for ``app``, each with who may call it. The handlers are methods
    of the Serve ingress class: the guards find its ``authenticator`` (and its
    ``console``) on ``self``."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.access: dict[tuple[str, str], RouteAccess] = {}

    def __call__(self, method: str, path: str, access: RouteAccess, body: BodyKind | None = None) -> Callable:
        """``body``: the kind of body the route reads (body_bounds.py; None: its method's
        default), which bounds its size and the time it may take to arrive."""
        if access not in KINDS:
            raise ValueError(f"{method} {path}: unknown access {access!r}")

        def register(handler: Callable) -> Callable:
            declared = getattr(handler, "route_access", None)
            if declared is not None and declared != access:  # stacked routes of one handler share its access
                raise ValueError(f"{method} {path}: {handler.__qualname__} is already a {declared!r} route")
            guarded = handler if declared is not None else GUARDS[access](handler)
            setattr(guarded, "route_access", access)  # noqa: B010 (a function's attribute)
            self.access[(method, path)] = access
            self.app.router.add_api_route(path, guarded, methods=[method], route_class_override=bounded_route(body))
            return guarded

        return register


def _self_and_request(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Request]:
    # Serve's class-based view passes every argument by keyword (``self`` included).
    owner = kwargs["self"] if "self" in kwargs else args[0]
    request = kwargs.get("request")
    if not isinstance(request, Request):
        raise TypeError("a guarded route's handler takes the request as `request`")
    return owner, request


def _open(handler: Callable) -> Callable:
    return handler


def _key_checked(handler: Callable) -> Callable:
    @functools.wraps(handler)
    async def guarded(*args, **kwargs) -> Response:
        started = start_credential_check()
        try:
            response = await handler(*args, **kwargs)
            checked = credential_checked()
        finally:
            reset_credential_checked(started)
        if response.status_code < 400 and checked != "key":
            logger.error("%s answered %d without checking the caller's key", handler.__qualname__, response.status_code)
            raise OpenAIError(500, "The server had an error processing your request.", type="server_error")
        return response

    return guarded


def _admin_first(handler: Callable) -> Callable:
    @functools.wraps(handler)
    async def guarded(*args, **kwargs) -> Response:
        owner, request = _self_and_request(args, kwargs)
        request.state.admin = await owner.authenticator.admin_actor(request.headers)
        return await handler(*args, **kwargs)

    return guarded


def _session_first(handler: Callable) -> Callable:
    @functools.wraps(handler)
    async def guarded(*args, **kwargs) -> Response:
        owner, request = _self_and_request(args, kwargs)
        request.state.admin = await owner.console.session_admin(request)
        return await handler(*args, **kwargs)

    return guarded


GUARDS: dict[RouteAccess, Callable[[Callable], Callable]] = {
    "probe": _open,
    "key": _key_checked,
    "admin": _admin_first,
    "console": _session_first,
}
