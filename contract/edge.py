"""What the edge (Ray's HAProxy with cluster/haproxy_edge.py's settings) tells the
ingress about each request it forwards."""

# When HAProxy had the request (its headers read), in microseconds since the epoch: a
# trace's "edge" span (serve_app/tracing.py) runs from it to the ingress taking the
# request. HAProxy sets it on every request, replacing what a client sent under it.
EDGE_TIME_HEADER = "x-llm-edge-us"

# Where a model with ``direct_route`` answers (``model_config.direct_route_prefix``:
# this root, then the model's name with "/" written "--"), and the routes of ``/v1``
# the edge sends there itself, in one hop, when the body's ``model`` names such a model
# (cluster/haproxy_edge.py); the direct route answers each (serve_app/http/direct.py).
DIRECT_ROUTE_ROOT = "/direct/"
ONE_HOP_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
