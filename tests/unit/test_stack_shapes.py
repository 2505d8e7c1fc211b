"""The test stacks run what `make run` ships: each shared stack's application args are
configs/local.yaml's (direct routes on), changed only where the stack declares it
(``stack.LOCAL_SHAPE`` for every stack, each package's ``SHAPE`` for its own), and
every declared change is still made (a stale declaration fails too)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
from stack import LOCAL_SHAPE, local_app_args, shipped_app_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the stacks' packages

from direct_route_stack import stack_args as direct_route_stack  # noqa: E402
from quota_stack import stack_args as quota_stack  # noqa: E402
from shared_stack import stack_args as shared_stack  # noqa: E402

REDIS = "redis://127.0.0.1:1/0"
STACKS = {
    "shared_stack": (lambda: shared_stack.app_args(REDIS, "admin", "http://127.0.0.1:1"), shared_stack.SHAPE),
    "quota_stack": (
        lambda: quota_stack.app_args(REDIS, "http://127.0.0.1:1/jwks", "http://127.0.0.1:1"),
        quota_stack.SHAPE,
    ),
    "direct_route_stack": (lambda: direct_route_stack.app_args(REDIS), direct_route_stack.SHAPE),
    # tests/e2e/conftest.py's module stack
    "e2e module stack": (lambda: {**local_app_args(), "redis_url": REDIS}, {"redis_url": "the module's Redis"}),
}


def differences(shipped: Any, tested: Any, path: str = "") -> Iterator[str]:
    """The dotted paths where ``tested`` differs from ``shipped``: a key on one side
    only is named whole; models are matched by name (``models.<name>.…``)."""
    if isinstance(shipped, list) and isinstance(tested, list) and path == "models":
        shipped, tested = ({model["name"]: model for model in side} for side in (shipped, tested))
    if isinstance(shipped, dict) and isinstance(tested, dict):
        for key in sorted(shipped.keys() | tested.keys()):
            where = f"{path}.{key}" if path else key
            if key not in shipped or key not in tested:
                yield where
            else:
                yield from differences(shipped[key], tested[key], where)
    elif shipped != tested:
        yield path


def covered(path: str, pattern: str) -> bool:
    """``pattern`` declares ``path``'s change: it matches the path or one above it."""
    parts = path.split(".")
    return any(fnmatch(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1))


def undeclared_and_stale(tested: dict, declared: dict[str, str]) -> tuple[list[str], list[str]]:
    found = list(differences(shipped_app_args(), tested))
    undeclared = [path for path in found if not any(covered(path, pattern) for pattern in declared)]
    stale = [pattern for pattern in declared if not any(covered(path, pattern) for path in found)]
    return undeclared, stale


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_shared_stack_differs_from_the_shipped_config_only_where_it_says(stack):
    build, shape = STACKS[stack]
    undeclared, stale = undeclared_and_stale(build(), {**LOCAL_SHAPE, **shape})
    assert undeclared == [], f"{stack} differs from configs/local.yaml where it does not declare it"
    assert stale == [], f"{stack} declares changes it does not make"


@pytest.mark.parametrize("stack", ["shared_stack", "quota_stack"])
def test_the_shared_stacks_keep_every_direct_route_as_shipped(stack):
    build, _ = STACKS[stack]
    shipped = {model["name"]: model.get("direct_route") for model in shipped_app_args()["models"]}
    tested = {model["name"]: model.get("direct_route") for model in build()["models"] if model["name"] in shipped}
    assert tested and all(tested.values()), tested
    assert tested == {name: shipped[name] for name in tested}


def test_a_stack_that_drops_a_direct_route_or_changes_a_model_fails_the_check():
    build, shape = STACKS["shared_stack"]
    args = build()
    args["models"][0].pop("direct_route")
    args["models"][1]["deployment"]["max_ongoing_requests"] = 1
    undeclared, stale = undeclared_and_stale(args, {**LOCAL_SHAPE, **shape})
    assert undeclared == ["models.minilm.deployment.max_ongoing_requests", "models.tiny-llama.direct_route"]
    assert stale == []
    # The ingress' path is a variant a test asks for by name.
    assert "models.tiny-llama.direct_route" in differences(shipped_app_args(), local_app_args(ingress_path=True))


def test_a_declared_change_the_stack_no_longer_makes_is_stale():
    build, shape = STACKS["direct_route_stack"]
    undeclared, stale = undeclared_and_stale(build(), {**LOCAL_SHAPE, **shape, "store": "no longer set"})
    assert (undeclared, stale) == ([], ["store"])
