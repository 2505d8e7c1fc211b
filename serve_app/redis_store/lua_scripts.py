"""Lua scripts shipped beside the code that calls them, registered with the client.

Each room keeps its scripts in its own ``lua/`` folder (admission's five, accounting's
storage account); redis-py's ``register_script`` loads one once and calls it by SHA
(``EVALSHA``, falling back to ``EVAL`` after a Redis restart flushed the script cache).
"""

from __future__ import annotations

from importlib import resources


def source(package: str, name: str) -> str:
    """The text of ``lua/<name>.lua`` in ``package`` (installed as package data)."""
    return (resources.files(package) / "lua" / f"{name}.lua").read_text()


def register(redis, package: str, name: str):
    """``lua/<name>.lua`` of ``package`` registered with ``redis`` (a callable script)."""
    return redis.register_script(source(package, name))
