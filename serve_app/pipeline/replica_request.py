"""What the gateway sets on a request before a replica gets it, in one place.

The client's body is checked and made canonical before the gateway plans it
(wire/api_requests.py, the parameter policy, a dialect's or the Responses API's
translation). Beside it the gateway decides a few fields of its own, and writes them
here alone, into a copy, on the way to the replica (``replica_body``): nothing on the
path writes the client's body (tests/unit/test_replica_request.py reads the modules).

- ``model`` (``Gateway._plan``): the name vLLM serves the model under (an alias
  resolved; an adapter the replica names itself).
- ``max_tokens`` or ``max_output_tokens`` (``Gateway._plan``, from wire/reservation.py):
  only when the client named none, so the engine never picks its own (up to the
  context) past what was reserved.
- ``priority`` (``Gateway._plan``): the key's tier in the engine's scheduler, on a
  model with priority scheduling.
- ``cache_salt`` (``Gateway._isolate``): the tenant's (identity/cache_isolation.py),
  removed where the request shares everyone's cache; never the client's own.
- ``request_id`` (``Gateway._admit``, ``_start_early``): the gateway's id, which the
  engine's request and the records carry.
- ``stream_options.include_usage`` (a stream's call): the usage that settles the
  reservation, always asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Every field of the body a replica gets that the gateway may set (the table above).
GATEWAY_FIELDS = ("model", "max_tokens", "max_output_tokens", "priority", "cache_salt", "request_id", "stream_options")


@dataclass
class GatewayFields:
    """The fields the gateway sets on one request (None: left as the client's body has it)."""

    model: str
    max_tokens_field: str | None = None  # "max_tokens" or "max_output_tokens", when the client named none
    max_tokens: int | None = None
    priority: int | None = None
    salted: bool = False  # the operation carries a tenant's salt (else the body's field is the policy's)
    cache_salt: str | None = None  # when salted: the tenant's, or None for everyone's cache
    request_id: str | None = None
    include_usage: bool = False


def replica_body(body: Mapping[str, Any], fields: GatewayFields) -> dict[str, Any]:
    """The body a replica gets: the client's ``body`` (unchanged) with ``fields`` set."""
    sent = dict(body)
    sent["model"] = fields.model
    if fields.max_tokens_field is not None and fields.max_tokens is not None:
        sent[fields.max_tokens_field] = fields.max_tokens
    if fields.priority is not None:
        sent["priority"] = fields.priority
    if fields.salted:
        if fields.cache_salt is None:
            sent.pop("cache_salt", None)
        else:
            sent["cache_salt"] = fields.cache_salt
    if fields.request_id is not None:
        sent["request_id"] = fields.request_id
    if fields.include_usage:
        options = sent.get("stream_options")
        sent["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return sent
