"""The cache salts' secret store for unit tests whose Redis is faked: a gateway needs
one (serve_app/identity/cache_isolation.py); on the real stack's Redis Cluster the
secret is made and read by tests/e2e/shared_stack/test_cache_isolation_e2e.py's stack."""

from serve_app.identity.cache_isolation import CacheSalts


class SecretStore:
    """Redis' SET NX and GET, in memory."""

    def __init__(self):
        self.values: dict[str, str] = {}

    async def set(self, name, value, nx=False):
        if nx and name in self.values:
            return None
        self.values[name] = value
        return True

    async def get(self, name):
        return self.values.get(name)


def salts() -> CacheSalts:
    return CacheSalts(SecretStore())
