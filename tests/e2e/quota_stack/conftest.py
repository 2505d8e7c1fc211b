"""One stack for this package's modules (package scope), as tests/e2e/shared_stack
does for the default shape: a persistent Redis (the quota tests stop and restart
it) and the application of stack_args.py. Modules run in their numbered order;
test_2_quotas_e2e.py ends with a Redis outage, so it is last."""

from __future__ import annotations

import pytest
from jwks_server import Jwks
from otlp_receiver import running_otlp_receiver
from ports import free_port
from redis_server import running_redis
from stack import serve_stack

from quota_stack.stack_args import app_args


@pytest.fixture(scope="package")
def redis_server():
    with running_redis(persistent=True) as server:
        yield server


@pytest.fixture(scope="package")
def jwks():
    """The identity provider whose tokens the stack accepts (one RS256 key, "k1")."""
    server = Jwks()
    server.add("k1")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def otlp():
    """Where the stack sends its traces (test_1_trace_sampling_e2e.py)."""
    with running_otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def base_url(redis_server, jwks, otlp):
    with serve_stack(app_args(redis_server.url, jwks.url, otlp.endpoint), port=free_port()) as url:
        yield url
