"""The HTTP surface: the ingress deployment and its route table, a model's direct
route, how every route turns a request into a ``Call`` and answers it, the edge's
header checks, and readiness."""
