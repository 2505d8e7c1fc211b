import pytest
from redis_server import every_node, running_redis, running_redis_cluster, running_redis_sentinel

from serve_app.redis_store import redis_client


@pytest.fixture(scope="session")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """3 primaries, 3 replicas (serve_app/redis_store/redis_client.py's redis+cluster://)."""
    with running_redis_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel():
    """1 primary, 1 replica, 3 sentinels (redis+sentinel://)."""
    with running_redis_sentinel() as setup:
        yield setup


@pytest.fixture(params=["node", "cluster", "sentinel"])
def redis_url(request, redis_server):
    """Every test that takes it (or ``redis``) runs on one node, on a Redis
    Cluster and on a Sentinel-managed primary: the same scripts, keys and
    pipelines must hold on each."""
    if request.param == "node":
        return redis_server.url
    return request.getfixturevalue(f"redis_{request.param}").url


@pytest.fixture
async def redis(redis_url):
    client = redis_client.connect(redis_url)
    await client.flushdb(**every_node(client, primaries=True))
    yield client
    await client.aclose()
