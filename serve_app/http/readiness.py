"""Readiness: can this stack answer a request for every model it should keep up?

``/health`` says the ingress process is alive (liveness). ``/ready`` (and
SageMaker's ``/ping``) says more: every configured model that does not scale
to zero has a replica Serve reports RUNNING (its health check asks the engine)
and that has answered a real call through the ingress (the model's details).
A load balancer, `make run`'s banner and the test stacks wait for it, so the
first request a user sends is never the one that meets a model still loading.

Both routes are unauthenticated, so they say only "ready" or not and how many
models are; never which models exist. Serve's status is read at most once per
``STATUS_TTL_S`` however often a probe (or a flood of them) asks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from contract.model_config import ModelConfig

logger = logging.getLogger("ray.serve")

STATUS_TTL_S = 1.0


class Readiness:
    def __init__(
        self,
        configs: list[ModelConfig],
        deployments: dict[str, str],
        describe: Callable[[str], bool],
        apps: dict[str, str] | None = None,
    ):
        """``deployments``: model name → its Serve deployment; ``describe(name)``:
        whether a replica of it has answered, starting a description if not;
        ``apps``: model name → the application its deployment is in, where not
        this one (a model with a direct route)."""
        self._kept_up = [c.name for c in configs if not c.scales_to_zero]
        self._deployments = deployments
        self._apps = apps or {}
        self._describe = describe
        self._running: dict[str, int] = {}
        self._read_at = float("-inf")
        self._reading: asyncio.Future | None = None

    async def check(self) -> tuple[bool, dict]:
        await self._fresh_status()
        ready = [name for name in self._kept_up if self._running.get(name, 0) > 0 and self._describe(name)]
        is_ready = len(ready) == len(self._kept_up)
        return is_ready, {
            "status": "ready" if is_ready else "starting",
            "models_ready": len(ready),
            "models": len(self._kept_up),
        }

    async def _fresh_status(self) -> None:
        if time.monotonic() - self._read_at < STATUS_TTL_S:
            return
        if self._reading is None:  # one read at a time, whoever asks
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._read_status))
        reading = self._reading
        try:
            self._running = await asyncio.shield(reading)
        except Exception:  # the controller is busy or away: not ready, say so
            logger.warning("could not read Serve's status", exc_info=True)
            self._running = {}
        finally:
            if self._reading is reading:
                self._reading = None
                self._read_at = time.monotonic()

    def _read_status(self) -> dict[str, int]:
        from ray import serve

        own = serve.get_replica_context().app_name
        applications = serve.status().applications
        running = {}
        for name, deployment in self._deployments.items():
            app = applications.get(self._apps.get(name, own))
            if app is not None and deployment in app.deployments:
                states = app.deployments[deployment].replica_states
                running[name] = sum(count for state, count in states.items() if state == "RUNNING")
        return running
