"""Keys, quotas and what a key keeps: authentication, admission and settlement in Redis
(one Lua script per step, ``lua/``), the Redis client and every key name it writes,
the local fallback limits, the storage accounts, and the admin operations on keys."""
