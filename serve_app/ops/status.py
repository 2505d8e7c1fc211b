"""`llmctl status`: the one command an operator runs first.

What runs (each deployment's replicas by state against its target), how busy
each model's engine is (running and waiting requests, KV-cache use, as a
replica's engine last reported them), and whether Redis answers (with the
number of keys). It joins the Ray cluster on this machine as a driver, reads
Serve's details from its controller, and asks each model deployment for its
engine load like any other caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from contract.model_config import deployment_name, direct_app_name

APP_NAME = "llm"
ENGINE_LOAD_TIMEOUT_S = 5.0


def serve_status(app_name: str = APP_NAME) -> dict[str, Any]:
    """Deployments of the application (and of its models' direct routes): status,
    replicas by state, target; each model's engine load. {"error": ...} when no Ray cluster or app is found."""
    from serve_app.ops.local_stack import LOOPBACK_RAY, running_stack_pid

    if running_stack_pid() is not None:  # `llmctl run`'s Ray is a one-node Ray on loopback: join it as one
        os.environ.update(LOOPBACK_RAY)  # (read when Ray is first imported, just below)
    import ray

    from serve_app.ray_private import serve_controller_client

    try:
        ray.init(address="auto", log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)
    except ConnectionError as exc:
        return {"error": f"no Ray cluster on this machine ({exc})"}
    try:
        # The controller's full view (what `serve status` reads through the dashboard);
        # serve.status() has no target replica counts.
        client = serve_controller_client()
        if client is None:
            return {"error": "no Serve controller on this Ray cluster"}
        details = client.get_serve_details()
        applications = details.get("applications", {})
        app = applications.get(app_name)
        if app is None:
            return {"error": f"no Serve application '{app_name}' runs"}
        # A model with a direct route has its deployment in an application of its own.
        served = {
            name: each
            for name, each in applications.items()
            if name == app_name or name.startswith(direct_app_name(""))
        }
        deployments, app_of = {}, {}
        for served_app, each in served.items():
            for name, deployment in each["deployments"].items():
                states: dict[str, int] = {}
                for replica in deployment.get("replicas", []):
                    state = _text(replica["state"])
                    states[state] = states.get(state, 0) + 1
                deployments[name] = {
                    "status": _text(deployment["status"]),
                    "target": deployment.get("target_num_replicas"),
                    "replicas": states,
                }
                app_of[name] = served_app
        for name, entry in deployments.items():
            if name.startswith(deployment_name("")) and entry["replicas"].get("RUNNING"):
                entry["engine"] = _engine_load(app_of[name], name)
        return {"application": _text(app["status"]), "deployments": deployments}
    finally:
        ray.shutdown()


def _text(value: Any) -> str:
    """Serve's enums (or their values) as their plain names."""
    return str(getattr(value, "value", value))


def _engine_load(app_name: str, deployment: str) -> dict[str, Any]:
    from ray import serve

    async def ask():
        handle = serve.get_deployment_handle(deployment, app_name=app_name)
        return await asyncio.wait_for(handle.engine_load.remote(), ENGINE_LOAD_TIMEOUT_S)

    try:
        return asyncio.run(ask())
    except Exception as exc:  # busy past the timeout, or going away: say so, do not fail the report
        return {"error": type(exc).__name__}


async def redis_status(redis_url: str) -> dict[str, Any]:
    import redis

    from serve_app.redis_store import redis_client, redis_names

    try:
        client = redis_client.connect(redis_url, timeout_s=2)
    except ValueError as exc:  # not a URL this gateway reads
        return {"reachable": False, "error": str(exc)}
    try:
        await client.ping()
        return {"reachable": True, "keys": await client.scard(redis_names.KEY_INDEX)}
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        return {"reachable": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        await client.aclose()


def render(serve_part: dict[str, Any], redis_part: dict[str, Any], redis_url: str) -> str:
    lines = []
    if "error" in serve_part:
        lines.append(f"serve: {serve_part['error']}")
    else:
        lines.append(f"application: {serve_part['application']}")
        lines.append(f"{'deployment':<28}{'status':<14}{'running':>8}{'starting':>9}{'target':>7}   engine")
        for name, entry in serve_part["deployments"].items():
            replicas = entry["replicas"]
            starting = sum(
                n for state, n in replicas.items() if state in ("STARTING", "PENDING_MIGRATION", "RECOVERING")
            )
            engine = entry.get("engine")
            if engine is None:
                engine_text = ""
            elif "error" in engine:
                engine_text = f"no answer ({engine['error']})"
            else:
                engine_text = (
                    f"{engine['running']} running, {engine['waiting']} waiting, KV {engine['kv_cache_usage']:.0%}"
                )
                if engine.get("prefix_cache_queries"):  # one replica's, since its engine started
                    engine_text += (
                        f", prefix cache hits {engine['prefix_cache_hits'] / engine['prefix_cache_queries']:.0%}"
                    )
            target = "" if entry["target"] is None else entry["target"]
            lines.append(
                f"{name:<28}{entry['status']:<14}{replicas.get('RUNNING', 0):>8}{starting:>9}{target:>7}   "
                f"{engine_text}"
            )
    from serve_app.redis_store.redis_client import redact

    shown = redact(redis_url)  # never a password on a terminal
    if redis_part["reachable"]:
        lines.append(f"redis: reachable ({shown}), {redis_part['keys']} keys")
    else:
        lines.append(f"redis: UNREACHABLE ({shown}): {redis_part['error']}")
    return "\n".join(lines)
