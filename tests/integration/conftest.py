import pytest
import redis.asyncio as aioredis

from redis_server import running_redis


@pytest.fixture(scope="session")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture
async def redis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()
