"""The API shapes of the platforms users migrate from.

Each module translates its platform's request into a ``Call`` (one of the
gateway's operations and a canonical OpenAI body) and, where the platform's
answer differs from OpenAI's, the gateway's ``Reply`` back into its shape.
They hold no state and do no I/O beyond asking the model registry
(``serve_app.wire.calls.ModelRegistry``, the narrow face of the gateway) about
models; the routes themselves are in ``serve_app.http.ingress``.
"""
