"""Outlier ejection: a replica that fails requests in a row is left out of its model's
routing choices for a cool-down, then let back in on probation.

The gateway says what happened to each call (``failed``, ``succeeded``: it alone
knows that a replica answered a 5xx, died under a request or sent nothing for
``first_token_timeout_s``); the model's request router asks ``choices`` before it
picks (serve_routers.py). Serve already drops a replica whose actor died; this
catches the replica that is up but failing: an engine that keeps erroring, one that
stalls.

- ``eject_after`` failures in a row eject a replica for ``cool_down_s``; a success
  in between clears its count.
- After the cool-down it is chosen again, on probation: its next failure ejects
  it again at once, for twice as long (at most ``MAX_BACKOFF`` times the first); a
  success clears everything.
- Never the last one: a failure that would leave the model no replica to choose
  does not eject, and ``choices`` never returns nothing for candidates it was given
  (all ejected: the one whose cool-down ends first).

Pure: a clock is passed in; no Ray. The per-process registry at the end is imported
by reference by the routers (as ``places.py``, for the same reason: Serve pickles a
router class by value, module globals included).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

MAX_BACKOFF = 16  # an ejection lasts at most this many first cool-downs


@dataclass
class _Health:
    failures: int = 0  # in a row
    ejected_until: float = 0.0
    ejections: int = 0  # in a row, each doubling the cool-down
    on_probation: bool = False


class OutlierEjector:
    def __init__(self, eject_after: int = 3, cool_down_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.eject_after = eject_after
        self.cool_down_s = cool_down_s
        self._clock = clock
        self._health: dict[str, _Health] = {}
        self._running: frozenset[str] | None = None  # the replicas the router last saw, once it has
        self.ejections = 0  # how many times a replica was ejected, since this process started

    def failed(self, replica: str) -> bool:
        """One more failure of ``replica``; True when it ejects it now."""
        if not replica:
            return False
        now = self._clock()
        health = self._health.setdefault(replica, _Health())
        if health.ejected_until > now:
            return False  # already out (a request it took before)
        health.failures += 1
        if health.failures < self.eject_after and not health.on_probation:
            return False
        if not self._others_choosable(replica, now):
            return False  # never the last one
        health.ejections += 1
        health.ejected_until = now + self.cool_down_s * min(2 ** (health.ejections - 1), MAX_BACKOFF)
        health.failures, health.on_probation = 0, True
        self.ejections += 1
        return True

    def succeeded(self, replica: str) -> None:
        """``replica`` answered: its record is clean again."""
        self._health.pop(replica, None)

    def choices(self, candidates: Sequence[str]) -> list[str]:
        """``candidates`` less the ejected; never empty when ``candidates`` is not."""
        now = self._clock()
        kept = [rid for rid in candidates if not self._ejected(rid, now)]
        if kept or not candidates:
            return kept
        return [min(candidates, key=lambda rid: self._health[rid].ejected_until)]

    def ejected(self) -> set[str]:
        """The replicas out of the choices now."""
        now = self._clock()
        return {rid for rid in self._health if self._ejected(rid, now)}

    def forget_others(self, running: Collection[str]) -> None:
        """Only ``running`` replicas exist now (the router's update)."""
        self._running = frozenset(running)
        self._health = {rid: health for rid, health in self._health.items() if rid in self._running}

    def _ejected(self, replica: str, now: float) -> bool:
        health = self._health.get(replica)
        return health is not None and health.ejected_until > now

    def _others_choosable(self, replica: str, now: float) -> bool:
        others = (self._running if self._running is not None else frozenset(self._health)) - {replica}
        return any(not self._ejected(rid, now) for rid in others)


# -- this process' view, shared by the gateway and the routers ------------------

_EJECTORS: dict[str, OutlierEjector] = {}
# Which replica took each call this process sent (a Serve ReplicaResult -> replica id),
# told by the router when the replica accepted it: a failure without an answer (a
# stall, a dead actor) is then the right replica's.
_TAKEN_BY: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()


def watch(deployment: str, ejector: OutlierEjector) -> OutlierEjector:
    """``deployment``'s replicas are judged by ``ejector`` in this process (the gateway
    registers one per model it calls); the first one registered stays."""
    return _EJECTORS.setdefault(deployment, ejector)


def ejector_of(deployment: str) -> OutlierEjector | None:
    return _EJECTORS.get(deployment)


def taken_by(call: object, replica: str) -> None:
    """``call`` (a Serve ReplicaResult) was accepted by ``replica``."""
    _TAKEN_BY[call] = replica


def replica_of(call: object | None) -> str:
    """The replica that accepted ``call`` ('' when not known)."""
    return _TAKEN_BY.get(call, "") if call is not None else ""
