"""Each model deployment's places (the sum of its running replicas' ``max_ongoing_requests``)
as the request routers in this process last saw them: the routers publish them
(serve_routers.py), fair share reads them (serve_app/pipeline/fair_share.py).

A module of its own, imported by reference: Serve pickles a custom router class by value,
module globals included, so a registry in the router's own module would be a copy the
gateway never sees."""

from __future__ import annotations

_PLACES: dict[str, int] = {}


def publish_places(deployment: str, places: int) -> None:
    _PLACES[deployment] = places


def replica_places(deployment: str) -> int | None:
    """``deployment``'s places, None until a router in this process has seen its replicas."""
    return _PLACES.get(deployment)
