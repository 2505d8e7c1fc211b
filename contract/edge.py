"""What the edge (Ray's HAProxy with cluster/haproxy_edge.py's settings) tells the
ingress about each request it forwards."""

import os

# When HAProxy had the request (its headers read), in microseconds since the epoch: a
# trace's "edge" span (serve_app/tracing.py) runs from it to the ingress taking the
# request. HAProxy sets it on every request, replacing what a client sent under it.
EDGE_TIME_HEADER = "x-llm-edge-us"
# The edge's own id of the request (a UUID), set the same way, and sent unchanged with
# each try HAProxy makes of it (a one-hop request whose replica died before answering
# is sent to another: cluster/haproxy_edge.py). The gateway admits a request under an
# id made of it (serve_app/accounting/usage.py ``edge_request_tag``), so a try again
# takes over the first try's admission and the request is charged once.
EDGE_REQUEST_HEADER = "x-llm-edge-request"

# Where a model with ``direct_route`` answers (``model_config.direct_route_prefix``:
# this root, then the model's name with "/" written "--"), and the routes of ``/v1``
# the edge sends there itself, in one hop, when the body's ``model`` names such a model
# (cluster/haproxy_edge.py); the direct route answers each (serve_app/http/direct.py).
DIRECT_ROUTE_ROOT = "/direct/"
ONE_HOP_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Under a direct route's prefix: what clients may name its model by (its name, aliases
# and LoRA adapters), which the edge reads from a replica when HAProxy's config is
# written, so that those names take the one hop too. Answered only to a request that
# did not come through the edge (it reads the replica itself).
EDGE_NAMES_PATH = "/-/edge-names"


# The client headers a credential comes in (a bearer token, Azure's api-key, Anthropic's
# x-api-key: serve_app/identity/authentication.py ``secret_from``), lower case; the edge
# hands them to a direct route's edge router with the body (cluster/haproxy_edge.py).
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")

# Requests carrying this header with one value are one conversation: they go to one
# replica of their model while its load allows (its cached history is there), at the
# edge for a direct route and in the ingress' request router otherwise. Ray Serve's own
# setting for its session stickiness names it; read where each process starts.
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
DEFAULT_SESSION_HEADER = "x-session-id"
# The longest session id used: a longer one is cut (it is only hashed).
MAX_SESSION_ID_CHARS = 256


def session_header() -> str:
    """The header naming a request's session, lower case."""
    return (os.environ.get(SESSION_HEADER_ENV) or DEFAULT_SESSION_HEADER).strip().lower()
