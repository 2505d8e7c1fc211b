"""One stack for this package, started as `make run` starts it: `llmctl run` of
the shipped configs/local.yaml (both models; only the port and Redis differ),
its own Ray, in a session of its own as a terminal's foreground job. Modules run
in their numbered order: the ready banner and the first requests after it, the
dashboards under load, then Ctrl-C, which ends the stack.

Ray's metrics export interval stays at its default (10 s): a shorter one also
shortens the time-to-live of gauges Serve sets less often (a replica's health,
every health-check period), and the dashboards would be tested on gaps
`make run` never has."""

from __future__ import annotations

import pytest
import yaml
from ports import free_port
from redis_server import running_redis
from stack import LOCAL_CONFIG, CliStack, assert_no_other_stack


@pytest.fixture(scope="package")
def redis_server():
    with running_redis(persistent=True) as server:  # the dashboard load stops and restarts it
        yield server


@pytest.fixture(scope="package")
def stack(redis_server, tmp_path_factory):
    assert_no_other_stack()
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["http_options"]["port"] = free_port()
    config["applications"][0]["args"]["redis_url"] = redis_server.url
    local = CliStack(config, redis_server.url, tmp_path_factory.mktemp("local-stack"))
    local.start()
    try:
        yield local
    finally:
        local.kill()
