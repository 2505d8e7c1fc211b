"""The stack every end-to-end module starts once (module scope): a real Redis,
Ray Serve with configs/local.yaml's models, an unlimited key, and clients.
A module that needs another shape (e.g. two ingress replicas) defines its own
``redis_server``/``base_url`` fixtures, which take precedence."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis as redis_sync
from ports import free_port
from redis_server import running_redis
from stack import create_key, local_app_args, serve_stack


@pytest.fixture(scope="module")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def redis(redis_server):
    """A synchronous client of the module's Redis, to assert on what the gateway stored."""
    client = redis_sync.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def base_url(redis_server):
    with serve_stack({**local_app_args(), "redis_url": redis_server.url}, port=free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def api_key(base_url, redis_server):
    return create_key(redis_server.url, "e2e-unlimited")[1]


@pytest.fixture(scope="module")
def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url, api_key):
    headers = {"authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as http_client:
        yield http_client
