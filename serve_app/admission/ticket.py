"""An admitted request as the request path holds it, and what that path needs of
admission: the one interface the gateway, the relay and the batch runner see
(``Gate``; serve_app/admission/gatekeeper.py is its implementation, wired by
serve_app/http/services.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from contract.replica_wire import Usage
from serve_app.accounting.costs import Rates
from serve_app.admission.scripts import LocalOrigin, Refusal
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord


@dataclass
class Ticket:
    """An admitted request: what settling it needs, and its response headers."""

    key: KeyRecord
    request_id: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    local: bool = False  # admitted by the local fallback, not by Redis
    origin: LocalOrigin | None = None  # when local: what its record keeps of the admission
    settled: bool = False
    # Called once when it is settled, whatever the outcome (the gateway frees the
    # request's fair-share place with it: every path ends in exactly one settlement).
    on_settle: Callable[[], None] | None = None
    # Set when its key is revoked or disabled while it runs: a stream's relay then
    # ends it at its next item, settled as what it delivered.
    revoked: bool = False
    # Called once when it is marked revoked (a unary call cancels itself with it).
    on_revoke: Callable[[], None] | None = None
    # Its model's prices for it (set by the gateway once admitted; None: not priced)
    # and its reservation as (prompt, completion) tokens, which price an unknown usage.
    rates: Rates | None = None
    reserved: tuple[int, int] = (0, 0)
    # The key's team when it has one: admitted, renewed and settled beside the key.
    team: TeamRecord | None = None
    # Its request's trace (serve_app/tracing.py; set by the gateway): settling it is a stage.
    trace: Any = None

    def levels(self) -> list[KeyRecord]:
        """The records it was admitted against: its key, and its team."""
        return [self.key] if self.team is None else [self.key, self.team]


class Gate(Protocol):
    """Admission as the request path uses it."""

    default_max_tokens: int

    async def team_of(self, key: KeyRecord, model: str) -> TeamRecord | None: ...

    def may_start_before_admission(self, key: KeyRecord, reserve_tokens: int) -> bool: ...

    def overloaded(self) -> bool: ...

    async def admit(
        self,
        key: KeyRecord,
        model: str,
        reserve_tokens: int,
        http_request_id: str = "",
        request_id: str | None = None,
        reserve_nanos: int = 0,
        request_paid: bool = False,
    ) -> Ticket | Refusal: ...

    async def withdraw(self, ticket: Ticket, keep_request: bool = False) -> None: ...

    async def refusal_before_body(self, key: KeyRecord) -> Refusal | None: ...

    def running(self, ticket: Ticket, replica: str = "") -> None: ...

    def settle(self, ticket: Ticket, status: str, usage: Usage | None = None, replica: str = "") -> None: ...
