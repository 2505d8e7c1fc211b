"""``OverlapGuard``: which keys' streams may start before their admission, bounded
by what Redis last reported (serve_app/admission/overlap.py)."""

from serve_app.admission.overlap import OverlapGuard
from serve_app.admission.seam import Decision
from serve_app.identity.keys import KeyRecord


def key(**limits) -> KeyRecord:
    return KeyRecord(id="k1", name="n", created_at=0, **limits)


def admitted(requests_remaining=-1, tokens_remaining=-1, detail="") -> Decision:
    return Decision(True, "", 0, requests_remaining, 0, tokens_remaining, 0, detail)


def guesses(guard: OverlapGuard, k: KeyRecord, tokens: int = 10, tries: int = 1000) -> int:
    return sum(guard.try_spend(k, tokens) for _ in range(tries))


def test_a_key_redis_has_not_admitted_here_is_never_guessed():
    assert guesses(OverlapGuard(), key()) == 0


def test_an_unlimited_key_is_guessed_after_its_first_admission():
    guard, k = OverlapGuard(), key()
    guard.admitted(k, admitted())
    assert guesses(guard, k, tokens=10**9) == 1000


def test_guesses_never_assume_more_requests_than_redis_reported_left():
    guard, k = OverlapGuard(), key(requests_per_minute=10)
    guard.admitted(k, admitted(requests_remaining=3))
    assert guesses(guard, k) == 3  # concurrent guesses each spend one


def test_guesses_never_assume_more_tokens_than_redis_reported_left():
    guard, k = OverlapGuard(), key(tokens_per_minute=1000)
    guard.admitted(k, admitted(tokens_remaining=250))
    assert not guard.try_spend(k, 251)  # larger than the room: waits for Redis
    assert guesses(guard, k, tokens=100) == 2


def test_budgets_bound_guesses_by_what_is_left_of_them():
    guard, k = OverlapGuard(), key(daily_token_budget=1000, monthly_token_budget=100_000)
    guard.admitted(k, admitted(detail="900,900"))  # 100 left today
    assert guesses(guard, k, tokens=40) == 2
    guard.admitted(k, admitted(detail="100,99990"))  # 10 left this month
    assert guesses(guard, k, tokens=11) == 0 and guesses(guard, k, tokens=5) == 2


def test_a_refusal_stops_guesses_until_redis_admits_the_key_again():
    guard, k = OverlapGuard(), key()
    guard.admitted(k, admitted())
    guard.refused(k)
    assert guesses(guard, k) == 0
    guard.admitted(k, admitted())
    assert guard.try_spend(k, 1)


def test_a_concurrency_limited_key_is_guessed_only_with_room_for_one_running_elsewhere():
    guard, k = OverlapGuard(), key(max_concurrent=3)
    guard.admitted(k, admitted())  # one running here
    assert guard.try_spend(k, 1)  # a second: one place still free
    guard.admitted(k, admitted())  # two running here
    assert not guard.try_spend(k, 1)
    guard.ended(k.id)
    assert guard.try_spend(k, 1)
    one = key(max_concurrent=1)
    guard.admitted(one, admitted())
    guard.ended(one.id)
    assert guesses(guard, one) == 0  # its only place may be taken on another replica


def test_a_refused_key_keeps_counting_its_running_requests():
    guard, k = OverlapGuard(), key(max_concurrent=3)
    guard.admitted(k, admitted())
    guard.admitted(k, admitted())
    guard.refused(k)
    guard.admitted(k, admitted())  # three running here now, not one
    assert not guard.try_spend(k, 1)


def test_the_keys_remembered_are_bounded():
    guard = OverlapGuard(max_keys=100)
    for n in range(10_000):
        guard.admitted(KeyRecord(id=f"k{n}", name="n", created_at=0), admitted())
    assert len(guard._rooms) == 100
    assert guard.try_spend(KeyRecord(id="k9999", name="n", created_at=0), 1)
    assert not guard.try_spend(KeyRecord(id="k0", name="n", created_at=0), 1)
    guard.ended("k0")  # forgotten: nothing to count down, nothing breaks
