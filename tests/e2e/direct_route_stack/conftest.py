"""One stack for this package's modules (package scope), as tests/e2e/shared_stack
does for the default shape: the application of stack_args.py and its own
single-node Redis, which the quota tests stall (SIGSTOP) and resume. Modules run
in their numbered order: the quota tests measure Redis' growth, so they come
before the direct route's tests write anything."""

from __future__ import annotations

import pytest
import redis as redis_sync
from ports import free_port
from redis_server import running_redis
from stack import serve_stack, wait_until_ready

from direct_route_stack.stack_args import app_args

READY_TIMEOUT_S = 300


@pytest.fixture(scope="package")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture(scope="package")
def redis(redis_server):
    """A synchronous client of the stack's Redis, to assert on what the gateway stored."""
    client = redis_sync.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="package")
def base_url(redis_server):
    with serve_stack(app_args(redis_server.url), port=free_port()) as url:
        wait_until_ready(url, READY_TIMEOUT_S)
        yield url
