"""LiteLLM's proxy for the benchmarks, configured the way a platform team runs it for
per-key limits: the peer users would pick instead of this stack.

- Its own virtualenv (``~/.cache/llm-cluster/litellm-<version>``, made on first use):
  LiteLLM pins its own FastAPI, pydantic and openai, which must not meet ours.
- One worker (``--num_workers 1``): one process, as each of this stack's replicas is.
- Every request carries a key that LiteLLM's ``custom_auth`` hook (no Postgres here, so
  no virtual keys in a database) turns into a key with limits: requests and tokens
  per minute and requests at once, the same never-binding limits as the stack's bench
  key (``BENCH_KEY_LIMITS``), so that its limiter counts every request.
- The limiter counts in Redis (the stack's, ``REDIS_URL``), as it must for several
  proxy pods to share a limit: ``general_settings.coordination_redis``, the Redis its
  rate limiter, spend counters and cross-pod coordination use, with no response cache.
- No cost map fetched from the network (``LITELLM_LOCAL_MODEL_COST_MAP``), no telemetry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml

LITELLM_VERSION = "1.108.7"
# Its Redis client: LiteLLM's proxy extra does not install one.
REDIS_PY_VERSION = "8.1.0"
VENV = Path.home() / ".cache" / "llm-cluster" / f"litellm-{LITELLM_VERSION}"

# The hook LiteLLM calls for every request's key (general_settings.custom_auth).
CUSTOM_AUTH = """
import json
import os

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

KEY = os.environ["BENCH_LITELLM_KEY"]
LIMITS = json.loads(os.environ["BENCH_LITELLM_LIMITS"])


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if api_key != KEY:
        raise Exception("invalid key")
    return UserAPIKeyAuth(api_key=api_key, **LIMITS)
"""


def litellm_python() -> Path:
    """The virtualenv's interpreter, the proxy installed in it (once)."""
    python = VENV / "bin" / "python"
    done = VENV / ".installed"
    if not done.exists():
        print(f"installing LiteLLM's proxy {LITELLM_VERSION} into {VENV}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                f"litellm[proxy]=={LITELLM_VERSION}",
                f"redis=={REDIS_PY_VERSION}",
            ],
            check=True,
        )
        done.touch()
    return python


def proxy_config(engine_url: str, model: str, redis_url: str) -> dict:
    redis = urlparse(redis_url)
    redis_params = {"host": redis.hostname or "127.0.0.1", "port": redis.port or 6379}
    return {
        "model_list": [
            {
                "model_name": model,
                # vLLM's OpenAI server, passed through as LiteLLM documents for it.
                "litellm_params": {"model": f"hosted_vllm/{model}", "api_base": f"{engine_url}/v1", "api_key": "none"},
            }
        ],
        "general_settings": {
            "master_key": "sk-bench-master",
            "custom_auth": "custom_auth.user_api_key_auth",
            # Where every pod's limiter counts (its internal usage cache's Redis), without
            # a response cache: proxy_server.py's `coordination_redis`.
            "coordination_redis": redis_params,
        },
    }


def key_limits(bench_limits: dict[str, int]) -> dict[str, int]:
    """The stack's bench key limits in LiteLLM's names."""
    return {
        "rpm_limit": bench_limits["requests_per_minute"],
        "tpm_limit": bench_limits["tokens_per_minute"],
        "max_parallel_requests": bench_limits["max_concurrent"],
    }


def litellm_command(
    engine_url: str, model: str, redis_url: str, work: Path, port: int, key: str, limits: dict[str, int]
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start the proxy on ``port`` in front of
    ``engine_url``, its config and hook written into ``work``."""
    python = litellm_python()
    work.mkdir(exist_ok=True)
    (work / "custom_auth.py").write_text(CUSTOM_AUTH)
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(proxy_config(engine_url, model, redis_url)))
    env = {
        **os.environ,
        "BENCH_LITELLM_KEY": key,
        "BENCH_LITELLM_LIMITS": json.dumps(key_limits(limits)),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "PYTHONPATH": str(work),
    }
    command = [str(python.with_name("litellm")), "--config", str(config), "--host", "127.0.0.1"]
    return [*command, "--port", str(port), "--num_workers", "1"], env
