"""What the edge (Ray's HAProxy with cluster/haproxy_edge.py's settings) tells the
ingress about each request it forwards."""

# When HAProxy had the request (its headers read), in microseconds since the epoch: a
# trace's "edge" span (serve_app/tracing.py) runs from it to the ingress taking the
# request. HAProxy sets it on every request, replacing what a client sent under it.
EDGE_TIME_HEADER = "x-llm-edge-us"
