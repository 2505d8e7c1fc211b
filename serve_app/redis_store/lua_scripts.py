"""Lua scripts shipped beside the code that calls them, registered with the client.

Each room keeps its scripts in its own ``lua/`` folder (admission's, accounting's
storage account); redis-py's ``register_script`` loads one once and calls it by SHA
(``EVALSHA``, falling back to ``EVAL`` after a Redis restart flushed the script cache).
"""

from __future__ import annotations

import re
from importlib import resources

INCLUDE = re.compile(r"^--#include (\w+)$", re.MULTILINE)


def source(package: str, name: str) -> str:
    """The text of ``lua/<name>.lua`` in ``package`` (installed as package data), with
    each ``--#include <other>`` line replaced by ``lua/<other>.lua`` of the same package:
    Redis scripts cannot share functions, so helpers are shared as text."""
    text = (resources.files(package) / "lua" / f"{name}.lua").read_text()
    return INCLUDE.sub(lambda line: source(package, line.group(1)), text)


def register(redis, package: str, name: str):
    """``lua/<name>.lua`` of ``package`` registered with ``redis`` (a callable script)."""
    return redis.register_script(source(package, name))
