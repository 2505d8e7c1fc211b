import pytest
import redis.asyncio as aioredis

from redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()
