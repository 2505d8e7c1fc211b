"""The ingress' FastAPI app and its route decorator: every route the ingress serves is
declared here with who may call it (serve_app/http/route_access.py), by the surface
modules beside this one."""

from __future__ import annotations

from serve_app.http.request_handling import openai_app
from serve_app.http.route_access import RouteAccess, Routes

app = openai_app("llm-cluster")
route = Routes(app)
# Who may call each route the ingress serves, by (method, path).
ROUTE_ACCESS: dict[tuple[str, str], RouteAccess] = route.access
