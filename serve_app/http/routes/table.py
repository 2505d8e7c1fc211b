"""The ingress' FastAPI app, its route decorator and what its routes use: every route the
ingress serves is declared with who may call it (serve_app/http/route_access.py), by the surface
modules beside this one."""

from __future__ import annotations

from serve_app.admin.operations import AdminStores
from serve_app.admission.seam import Admitter
from serve_app.http.console import Console
from serve_app.http.readiness import Readiness
from serve_app.http.request_handling import HandlesRequests, openai_app
from serve_app.http.route_access import RouteAccess, Routes
from serve_app.stored.batches import BatchStore
from serve_app.stored.files_api import FileStore
from serve_app.stored.stored_responses import ResponseStore

app = openai_app("llm-cluster")
route = Routes(app)
# Who may call each route the ingress serves, by (method, path).
ROUTE_ACCESS: dict[tuple[str, str], RouteAccess] = route.access


class IngressRoutes(HandlesRequests):
    """What the routes of every surface use of the ingress (serve_app/http/ingress.py sets it)."""

    gate: Admitter
    admin_stores: AdminStores
    console: Console
    readiness: Readiness
    responses: ResponseStore
    files: FileStore
    batches: BatchStore
