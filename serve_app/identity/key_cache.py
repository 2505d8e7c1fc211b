"""The ingress' cache of key records: bounded in entries and in age.

Every distinct bearer token a client sends would otherwise be a cache entry
for the life of the ingress (random tokens in a loop grow it until it dies),
and a record of any age would authenticate while Redis is down (a key revoked
long ago comes back). So:

- known keys: an LRU of at most ``max_keys`` records, each fresh for
  ``ttl_s`` (a revoked key stops within it);
- unknown tokens: a much smaller LRU, each for at most ``NEGATIVE_TTL_S``
  (a key created a moment ago works almost at once, and a flood of random
  tokens evicts only other random tokens);
- while Redis is unreachable, a record may stand in only if Redis confirmed it
  within ``stale_max_s``.
"""

from __future__ import annotations

import time
from typing import Generic, TypeVar

from cachetools import TTLCache

from serve_app.identity.keys import KeyRecord

NEGATIVE_TTL_S = 1.0
NEGATIVE_MAX = 1_000

# What is cached: key records (by a token's digest), or team records (by team id or name).
Record = TypeVar("Record", bound=KeyRecord)


class KeyCache(Generic[Record]):
    def __init__(self, ttl_s: float, stale_max_s: float, max_keys: int = 10_000, clock=time.monotonic):
        # TTLCache is an LRU with per-entry expiry (items live ``ttl`` from insertion).
        self._fresh: TTLCache[str, Record] | None = (
            TTLCache(maxsize=max_keys, ttl=max(ttl_s, 1e-9), timer=clock) if ttl_s > 0 else None
        )
        self._fallback: TTLCache[str, Record] = TTLCache(
            maxsize=max_keys, ttl=max(stale_max_s, ttl_s, 1e-9), timer=clock
        )
        self._unknown: TTLCache[str, bool] = TTLCache(
            maxsize=NEGATIVE_MAX, ttl=min(NEGATIVE_TTL_S, ttl_s) or 1e-9, timer=clock
        )

    def get(self, hashed: str) -> tuple[bool, Record | None]:
        """(hit, record): a fresh answer for this token's digest, if there is one;
        ``record`` is None for a token Redis said is no key."""
        if self._fresh is not None and (record := self._fresh.get(hashed)) is not None:
            return True, record
        if hashed in self._unknown:
            return True, None
        return False, None

    def put(self, hashed: str, record: Record | None) -> None:
        if record is None:
            self._unknown[hashed] = True
            if self._fresh is not None:
                self._fresh.pop(hashed, None)
            self._fallback.pop(hashed, None)  # revoked or deleted: never a fallback again
            return
        self._unknown.pop(hashed, None)
        if self._fresh is not None:
            self._fresh[hashed] = record
        self._fallback[hashed] = record

    def fallback(self, hashed: str) -> Record | None:
        """The record Redis confirmed within ``stale_max_s``, for use while it is unreachable."""
        return self._fallback.get(hashed)

    def __len__(self) -> int:
        return len(self._fallback) + len(self._unknown)
