"""One stack for every module of this package (package scope: started once,
stopped after the package's last test, before any other module starts its
own): a real Redis Cluster, Ray Serve with configs/local.yaml's models as
shipped, direct routes on (and the demo cross-encoder: stack_args.py), an admin
token, an unlimited key, and clients. The modules here only add keys and send
requests (a fault they cause, they wait out), so they can share it; a module
that needs another shape belongs in tests/e2e/ with its own fixtures.

The stack counts as started when /ready says so: every model has a replica
that answered (serve_app/http/readiness.py)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from otlp_receiver import running_otlp_receiver
from ports import free_port
from redis_server import running_redis_cluster, sync_client
from stack import create_key, serve_stack, wait_until_ready

from shared_stack.stack_args import app_args

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
READY_TIMEOUT_S = 300


@pytest.fixture(scope="package")
def redis_server():
    """A Redis Cluster (3 primaries, 3 replicas): the most common stack runs on the
    most demanding Redis shape, so every route's scripts and lookups are proven on
    a cluster end to end. The other e2e stacks run on one node."""
    with running_redis_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="package")
def redis(redis_server):
    """A synchronous client of the stack's Redis, to assert on what the gateway stored."""
    client = sync_client(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="package")
def admin_token():
    return ADMIN_TOKEN


@pytest.fixture(scope="package")
def otlp():
    """Where the stack sends its traces (test_tracing_e2e.py)."""
    with running_otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def stack_args(redis_server, otlp):
    return app_args(redis_server.url, ADMIN_TOKEN, otlp.endpoint)


@pytest.fixture(scope="package")
def records_dir(stack_args):
    """The stack's record sink (records.sink_dir, a directory of this run)."""
    return stack_args["records"]["sink_dir"]


@pytest.fixture(scope="package")
def base_url(stack_args):
    with serve_stack(stack_args, port=free_port()) as url:
        wait_until_ready(url, READY_TIMEOUT_S)
        yield url


@pytest.fixture(scope="package")
def api_key(base_url, redis_server):
    return create_key(redis_server.url, "e2e-unlimited")[1]


@pytest.fixture(scope="package")
def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def http(base_url, api_key):
    headers = {"authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as http_client:
        yield http_client
