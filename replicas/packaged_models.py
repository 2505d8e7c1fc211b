"""Weights shipped inside a Python package (a model's ``source: package:<module>``; the
demo reranker starts from one): no model hub at run time."""

from __future__ import annotations

import importlib
from pathlib import Path


def packaged_model_path(module_name: str) -> Path:
    """Weights shipped inside a Python package: its ``get_model_path()`` if it
    has one, else its ``model/`` folder."""
    module = importlib.import_module(module_name)
    if hasattr(module, "get_model_path"):
        return Path(module.get_model_path())
    if module.__file__ is None:
        raise ValueError(f"{module_name} is a namespace package: no model folder beside it")
    return Path(module.__file__).parent / "model"
