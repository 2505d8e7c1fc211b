"""Which replica of a model takes a request: Serve request routers over pure policies.

The policies (``policies.py``, ``block_index.py``) are plain functions and classes,
tested without Ray; ``serve_routers.py`` plugs them into Ray Serve; ``serve_private.py``
is the one module that reaches into Ray's private API (tests/unit/test_boundaries.py).
"""
