"""Relaying a replica's stream to the client and settling it: the usage trailer read
(and hidden from a client that did not ask for it), a key revoked mid-stream ended
with an error event, a failed stream charged what it delivered, a client gone
cancelled downstream (the engine aborts)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from contract.replica_wire import StreamStart, Usage
from serve_app.admission.seam import Admitter, Ticket
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.wire.reservation import Reservation
from serve_app.wire.sse import StreamShape

logger = logging.getLogger("ray.serve")

STREAM_FAILED = (
    'data: {"error": {"message": "The model stream failed.", "type": "server_error", "param": null, "code": null}}\n\n'
)
KEY_REVOKED = (
    'data: {"error": {"message": "This API key (or its team) was revoked or disabled while the stream ran.", '
    '"type": "authentication_error", "param": null, "code": "invalid_api_key"}}\n\n'
)


class KeyRevoked(Exception):
    """The key of a running stream was revoked or disabled."""


async def relay(
    start: StreamStart,
    chunks,
    ticket: Ticket,
    client_wants_usage: bool,
    record: RequestRecord,
    reservation: Reservation,
    chat: bool,
    shape: StreamShape,
    *,
    access: Admitter,
    telemetry: Telemetry,
    served: Callable[[str, str, Usage | None], None],
):
    """Relay the replica's stream and account for it.

    The usage event (always requested from the replica) is read from the
    final item and hidden unless the client asked for it. If the client goes
    away, cancel downstream (Serve cancels the replica's generator, vLLM aborts).
    A stream that fails (its replica or engine died: an exception here, or
    vLLM's own error event) is charged what it delivered, never its whole
    reservation: the prompt estimate plus one token per content event relayed
    (an event carries at least one token, up to ``stream_batch_tokens`` beside
    other streams, so this errs in the client's favour; chat's first event per
    choice is the role alone). ``served`` tells the model's fair-share queue what the
    key used, before its place goes to the next request."""
    status, usage, drained = "cancelled", None, False
    replica, first = start.replica, start.text
    events, last = 0, first
    try:
        first, usage = shape.usage(first, client_wants_usage)
        events, last = first.count("data: {"), first
        yield first
        if usage is not None:
            status = "completed"
        access.running(ticket, replica)
        async for chunk in chunks:
            if ticket.revoked:  # its key revoked while it runs (Maintenance.stop_revoked): ends below, as failed
                raise KeyRevoked
            if usage is None:
                chunk, usage = shape.usage(chunk, client_wants_usage)
            events += chunk.count("data: {")
            last = chunk
            yield chunk
            if usage is not None:
                # The client has the whole stream, usage trailer and [DONE]: it may
                # hang up now (the openai SDK closes at [DONE]) while the replica's
                # stream is still ending; that is a complete stream, charged its usage.
                status = "completed"
        drained = True
        # vLLM ends a stream whose engine failed with an error event and no usage.
        failed_upstream = usage is None and shape.failed(last)
        events -= failed_upstream
        status = "failed" if failed_upstream else "completed"
    except Exception:
        if usage is not None:  # failed after the final usage event: the client has it all
            status = "completed"
        elif ticket.revoked:
            status = "failed"
            yield KEY_REVOKED
        else:
            status = "failed"
            logger.exception("stream from replica failed")
            yield STREAM_FAILED
    finally:
        if not drained:
            chunks.cancel()
        if status == "failed":
            usage = delivered(events, reservation, chat)
        # The key's fair-share counter first, before its place goes to the next one;
        # a cancelled stream's usage is unknown: the counter takes what was relayed.
        served(record.model, ticket.key.id, usage or delivered(events, reservation, chat))
        # And its reservation stays charged.
        access.settle(ticket, status, None if status == "cancelled" else usage, replica)
        record.status, record.cancelled = 200, status == "cancelled"
        if status == "failed":
            record.error_code = "stream_failed"
        record.used(usage)
        telemetry.finish(record)


def delivered(events: int, reservation: Reservation, chat: bool) -> Usage:
    """What a failed stream is charged: its prompt (estimated) and one token per
    content event it relayed, never more than it reserved."""
    content_events = events - (reservation.choices if chat else 0)
    completion = min(max(0, content_events), reservation.completion_per_choice * reservation.choices)
    return Usage(reservation.prompt, completion)
