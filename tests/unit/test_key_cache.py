"""Pure logic: the ingress' key cache stays bounded and never revives an old record."""

from serve_app.identity.key_cache import NEGATIVE_MAX, NEGATIVE_TTL_S, KeyCache
from serve_app.identity.keys import KeyRecord


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(key_id="k1"):
    return KeyRecord(id=key_id, name=key_id, created_at=0)


def test_a_known_key_is_fresh_for_the_ttl_then_asked_again():
    clock = Clock()
    cache = KeyCache(ttl_s=5, stale_max_s=300, clock=clock)
    cache.put("h", record())
    assert cache.get("h") == (True, record())
    clock.now += 5.1
    assert cache.get("h") == (False, None)


def test_unknown_tokens_are_remembered_briefly_and_in_a_small_bounded_set():
    clock = Clock()
    cache = KeyCache(ttl_s=5, stale_max_s=300, clock=clock)
    cache.put("real", record())
    for i in range(20 * NEGATIVE_MAX):  # a flood of random tokens
        cache.put(f"random-{i}", None)
    assert len(cache) <= NEGATIVE_MAX + 1
    assert cache.get("real") == (True, record())  # the flood evicts only other random tokens
    assert cache.get(f"random-{20 * NEGATIVE_MAX - 1}") == (True, None)
    clock.now += NEGATIVE_TTL_S + 0.01
    assert cache.get(f"random-{20 * NEGATIVE_MAX - 1}") == (False, None)  # a key created now works


def test_known_keys_are_bounded_least_recently_used_first():
    cache = KeyCache(ttl_s=5, stale_max_s=300, max_keys=100, clock=Clock())
    for i in range(1000):
        cache.put(f"h{i}", record(f"k{i}"))
    assert len(cache) <= 100
    assert cache.get("h999")[0] and not cache.get("h0")[0]


def test_a_fallback_is_only_a_record_redis_confirmed_within_the_stale_bound():
    clock = Clock()
    cache = KeyCache(ttl_s=5, stale_max_s=60, clock=clock)
    cache.put("h", record())
    clock.now += 59
    assert cache.fallback("h") == record()
    clock.now += 2
    assert cache.fallback("h") is None  # a long-revoked key does not come back during an outage


def test_a_key_found_revoked_is_never_a_fallback():
    cache = KeyCache(ttl_s=5, stale_max_s=300, clock=Clock())
    cache.put("h", record())
    cache.put("h", None)
    assert cache.fallback("h") is None and cache.get("h") == (True, None)


def test_ttl_zero_asks_redis_every_time():
    cache = KeyCache(ttl_s=0, stale_max_s=300, clock=Clock())
    cache.put("h", record())
    assert cache.get("h") == (False, None) and cache.fallback("h") == record()
