"""The only routes without a credential: liveness and readiness (SageMaker's ``/ping``
too), which name no model and carry no tenant's data."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from serve_app.http.routes.table import IngressRoutes, route


class ProbeRoutes(IngressRoutes):
    """Liveness and readiness."""

    @route("GET", "/ping", "probe")
    async def sagemaker_ping(self) -> Response:
        # SageMaker sends traffic once /ping is 200: its readiness check.
        return await self.ready()

    @route("GET", "/health", "probe")
    async def health(self) -> JSONResponse:
        """Liveness: the ingress process answers."""
        return JSONResponse({"status": "ok"})

    @route("GET", "/ready", "probe")
    async def ready(self) -> JSONResponse:
        """Readiness: every model kept up has a replica that answers (serve_app/http/readiness.py)."""
        is_ready, body = await self.readiness.check()
        return JSONResponse(body, status_code=200 if is_ready else 503)
