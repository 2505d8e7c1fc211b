"""Every boundary docs/architecture.md ("Who owns what") draws between the folders, and
the soak's place above them (soak/), checked on the source: each module's imports (at
its top and inside functions) against what its folder may import. A new import across a
line fails here, naming the module."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("serve_app", "contract", "replicas", "autoscale", "cluster")
OURS = (*PRODUCT, "soak")  # the product and the soak that judges it
ENGINE = {"torch", "vllm", "transformers"}
# What the dialects may use of the gateway: the call they translate into and its
# model questions (calls.ModelRegistry), errors, key records, and the request helpers.
DIALECT_MAY_USE = {
    "serve_app.wire.calls",
    "serve_app.errors",
    "serve_app.identity.keys",
    "serve_app.wire.api_requests",
    "serve_app.wire.reservation",
    "serve_app.wire.sse",
}
# The gateway modules that may import replicas/: the app builder and the direct route
# (they deploy the replica class) and the operator's CLI (it builds the demo model).
MAY_IMPORT_REPLICAS = {"serve_app.app", "serve_app.http.direct", "serve_app.cli", "serve_app.ops.local_stack"}


def modules(package: str) -> list[tuple[str, Path]]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found.append((name, path))
    return found


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as written (absolute imports only: the project uses no relative ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def ours(names: set[str]) -> set[str]:
    return {name for name in names if name.split(".")[0] in OURS}


def top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def stdlib_or(allowed: set[str], names: set[str]) -> set[str]:
    """The names that are neither the standard library nor in ``allowed``."""
    return {name for name in top(names) if name not in sys.stdlib_module_names and name not in allowed}


@pytest.mark.parametrize("module, path", modules("contract"))
def test_the_contract_is_pydantic_and_the_standard_library(module, path):
    assert not stdlib_or({"contract", "pydantic", "__future__"}, imports(path))


@pytest.mark.parametrize("module, path", modules("serve_app/dialects"))
def test_a_dialect_translates_and_uses_no_more_of_the_gateway_than_its_registry(module, path):
    used = {name for name in ours(imports(path)) if not name.startswith("serve_app.dialects")}
    modules_used = {
        name if name in DIALECT_MAY_USE or name.count(".") == 1 else name.rsplit(".", 1)[0] for name in used
    }
    assert modules_used <= DIALECT_MAY_USE, modules_used - DIALECT_MAY_USE
    assert not top(imports(path)) & {"redis", "ray"}


@pytest.mark.parametrize("module, path", modules("serve_app"))
def test_the_gateway_imports_no_engine_and_replicas_only_where_it_deploys_them(module, path):
    names = imports(path)
    assert not top(names) & ENGINE
    if module not in MAY_IMPORT_REPLICAS:
        assert "replicas" not in top(names), module
    assert not top(names) & {"cluster", "autoscale"}  # those are named by import path in configs


# serve_app/ by role, each folder importing only the folders below it (docs/architecture.md,
# "Who owns what"). At the bottom what keeps state in Redis stands on (its client, key
# names and scripts), the limits an account carries and appending to a file whole (appends);
# then the shared modules (errors,
# settings, telemetry, tracing); the wire types; then the rooms of the quota service, each
# on the one below: who is calling (identity), what was used and cost (accounting), whether
# a request runs now (admission). Above them the request path and the dialects; stored
# objects and the admin operations; the HTTP layer that serves them all; Serve's entry
# point (app); what operators run beside it (ops: the local stack builds the app's config)
# and llmctl (cli).
LAYERS = {
    "ray_private": 0,
    "redis_store": 0,
    "limits": 0,
    "appends": 0,
    "errors": 1,
    "settings": 1,
    "telemetry": 1,
    "tracing": 1,
    "wire": 2,
    "routing": 2,
    "identity": 3,
    "accounting": 4,
    "admission": 5,
    "pipeline": 6,
    "dialects": 6,
    "stored": 7,
    "admin": 7,
    "http": 8,
    "app": 9,
    "ops": 10,
    "cli": 11,
}


def part_of(name: str) -> str:
    return name.split(".")[1]


@pytest.mark.parametrize("module, path", modules("serve_app"))
def test_a_gateway_folder_imports_only_the_folders_below_it(module, path):
    if module == "serve_app":
        return
    mine = LAYERS[part_of(module)]
    for name in ours(imports(path)):
        if not name.startswith("serve_app.") or part_of(name) == part_of(module):
            continue
        target = part_of(name)
        assert target in LAYERS, f"{module} imports {name}: a folder the layers do not know"
        assert LAYERS[target] < mine, f"{module} (layer {mine}) imports {name} (layer {LAYERS[target]})"


# Admission's seam (serve_app/admission/seam.py) is all the rest of the product imports of
# admission but the gatekeeper and its own loops: the Redis scripts are the gatekeeper's.
ADMISSION_INSIDE = {"serve_app.admission.gatekeeper", "serve_app.admission.scripts"}
SEAM_BELOW = {"serve_app.accounting", "serve_app.identity", "contract"}


@pytest.mark.parametrize("module, path", [m for package in OURS for m in modules(package)])
def test_admission_is_seen_through_its_seam(module, path):
    names = imports(path)
    if module not in ADMISSION_INSIDE:
        assert "serve_app.admission.scripts" not in names, f"{module} imports admission's scripts: use its seam"
    if module == "serve_app.admission.seam":  # values and a protocol: nothing of how admission runs
        assert all(any(name.startswith(below) for below in SEAM_BELOW) for name in ours(names)), ours(names)


# Ray's private modules, each reached through one adapter module of ours: a Ray upgrade
# that moves one breaks there alone (Serve's routers; the local twin's node provider).
PRIVATE_ADAPTERS = {
    "serve_app.ray_private": "ray.serve._private",
    "cluster.ray_private": "ray.autoscaler._private",
}


@pytest.mark.parametrize("module, path", [m for package in OURS for m in modules(package)])
def test_only_the_adapters_import_ray_private_modules(module, path):
    private = {name for name in imports(path) if "._private" in name or name.startswith("_private")}
    if module in PRIVATE_ADAPTERS:
        assert all(name.startswith(PRIVATE_ADAPTERS[module]) for name in private), private
    else:
        assert not private, f"{module} imports {private}: reach it through {sorted(PRIVATE_ADAPTERS)}"


def test_the_adapters_were_read_against_the_ray_that_runs():
    """A Ray upgrade makes every private member an adapter reaches a question: this fails
    until its entries are read again against the new version and RAY_VERSION_READ says so."""
    import importlib.metadata
    import tomllib

    from serve_app.ray_private import RAY_VERSION_READ

    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"ray[serve]=={RAY_VERSION_READ}" in pinned
    assert importlib.metadata.version("ray") == RAY_VERSION_READ


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def defined_private_names() -> set[str]:
    """Every ``_``-name our code defines: functions, classes, parameters, attributes it
    assigns, module names. A ``_``-name it uses that none of these is another's."""
    names = set()
    for package in OURS:
        for _, path in modules(package):
            names.add(path.stem)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.alias):
                    names.add(node.asname or node.name.split(".")[-1])
    return {name for name in names if _is_private(name)}


OUR_PRIVATE_NAMES = defined_private_names()


def rays_private_names() -> set[str]:
    """The ``_``-names Ray Serve, Ray's metrics and its fake node provider define (what
    a duck-typed stand-in of ours may define too: the in-process replica's response)."""
    import ray

    root = Path(ray.__file__).parent
    names = set()
    for folder in ("serve", "util", "autoscaler/_private/fake_multi_node"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _is_private(node.id):
                    names.add(node.id)  # a dataclass field among them
    return names


# ``_``-names their libraries document as public: os._exit, redis-py's scan ``_type``.
PUBLIC_UNDERSCORE_NAMES = {"_exit", "_type"}
# Other libraries' private members, each where it is used and why no public API serves.
OTHER_LIBRARIES_PRIVATE = {
    # Starlette's MultiPartParser has no hook for a part's headers before it is read.
    "serve_app.stored.upload_form": {"_current_part"},
    # torch's AMX tile set-up, as vLLM's CPU worker does it (no public call).
    "replicas.cpu_amx": {"_is_amx_tile_supported", "_init_amx"},
}


@pytest.fixture(scope="module")
def rays_private() -> set[str]:
    return rays_private_names()


@pytest.mark.parametrize("module, path", [m for package in OURS for m in modules(package)])
def test_only_the_adapters_touch_another_librarys_private_members(module, path, rays_private):
    """Ray's private members (and any other library's) are reached in the adapters only:
    an attribute or keyword argument named ``_x`` that our code does not define is
    someone else's, which their next release may move without a word."""
    if module in PRIVATE_ADAPTERS:
        return
    allowed = OTHER_LIBRARIES_PRIVATE.get(module, set()) | PUBLIC_UNDERSCORE_NAMES
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        name = node.attr if isinstance(node, ast.Attribute) else node.arg if isinstance(node, ast.keyword) else None
        if not name or not _is_private(name) or name in allowed:
            continue
        # Ours, unless it is also Ray's and read off another object than self (a
        # stand-in of ours may define a Ray object's private method: the call is Ray's).
        on_another = isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        )
        if name not in OUR_PRIVATE_NAMES or (on_another and name in rays_private):
            found.add(f"{path.name}:{node.lineno} {name}")
    assert not found, f"reach these through {sorted(PRIVATE_ADAPTERS)}: {sorted(found)}"


@pytest.mark.parametrize(
    "module", ["serve_app.routing.policies", "serve_app.routing.block_index", "serve_app.routing.places"]
)
def test_routing_policies_are_pure(module):
    """The routers' decisions run and are tested without Ray (serve_routers.py plugs them in)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    assert not stdlib_or({"__future__", "contract", "serve_app"}, imports(path))
    assert top(ours(imports(path))) <= {"contract", "serve_app"}


@pytest.mark.parametrize("module, path", modules("replicas"))
def test_a_replica_knows_the_contract_and_nothing_of_the_gateway(module, path):
    assert not top(ours(imports(path))) - {"replicas", "contract"}


@pytest.mark.parametrize("module, path", modules("autoscale"))
def test_autoscaling_knows_the_contract_only(module, path):
    assert not top(ours(imports(path))) - {"autoscale", "contract"}
    if module == "autoscale.policy":  # a pure function: no Serve or Ray
        assert not stdlib_or({"__future__"}, imports(path))


@pytest.mark.parametrize("module, path", modules("cluster"))
def test_cluster_code_stands_apart(module, path):
    assert not top(ours(imports(path))) - {"cluster", "contract"}  # the names it shares: contract/


# The soak (soak/) stands above the product and drives it from outside: it runs the
# gateway, the replicas and the twin as processes (`ray up`, `serve deploy`) and reaches
# them over HTTP and Redis, using of the code only the gateway's operator surfaces (the
# admin operations as llmctl runs them, its settings and Redis key names, the app's config
# builder) and the names the product shares (contract/). No engine: it judges what is
# served, it loads no model. Its verdict (soak/ledger.py) reads records and observations
# alone, the standard library only, so no product module it judges takes part in judging.
# Nothing of the product imports soak/: a harness the product leans on could not judge it.
SOAK_MAY_IMPORT = {"soak", "serve_app", "contract"}


@pytest.mark.parametrize("module, path", modules("soak"))
def test_the_soak_drives_the_product_from_above(module, path):
    names = imports(path)
    assert not top(ours(names)) - SOAK_MAY_IMPORT, f"{module} imports {top(ours(names)) - SOAK_MAY_IMPORT}"
    assert not top(names) & ENGINE, module
    if module == "soak.ledger":
        assert not stdlib_or({"__future__"}, names)


@pytest.mark.parametrize("module, path", [m for package in PRODUCT for m in modules(package)])
def test_the_product_imports_nothing_of_the_soak(module, path):
    assert "soak" not in top(imports(path)), module


def test_every_import_path_a_config_names_resolves():
    from contract.autoscaling import POLICY_IMPORT_PATH
    from contract.model_config import CACHE_AFFINITY_ROUTER, POWER_OF_TWO_ROUTER, PREFIX_AFFINITY_ROUTER

    for path in (
        POLICY_IMPORT_PATH,
        POWER_OF_TWO_ROUTER,
        PREFIX_AFFINITY_ROUTER,
        CACHE_AFFINITY_ROUTER,
        "serve_app.app:build_app",
        "serve_app.app:build_direct_app",
        "serve_app.cli:main",
        "cluster.haproxy_guard:main",
        "replicas.engine_guard:register",
    ):
        module, _, attribute = path.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), path


# The quota services are built and wired in one place (serve_app/http/services.py): the
# request path sees admission through admission.seam.Admitter, the routes the
# Authenticator they are handed, the admin operations their AdminStores.
SERVICES = {"Gatekeeper", "Maintenance", "Authenticator", "IngressReplicas"}
BUILDERS = {"serve_app.http.services"}


def constructed(path: Path) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


@pytest.mark.parametrize("module, path", modules("serve_app"))
def test_only_the_builder_constructs_the_quota_services(module, path):
    if module not in BUILDERS:
        assert not constructed(path) & SERVICES, f"{module} builds {constructed(path) & SERVICES}"
    if module not in BUILDERS | {"serve_app.admission.maintenance"}:
        assert "serve_app.admission.gatekeeper" not in imports(path), module
    if module not in BUILDERS:
        assert "serve_app.admission.maintenance" not in imports(path), module


def module_graph() -> dict[str, set[str]]:
    """Each module of ours -> the modules of ours it imports (at its top or inside a function)."""
    known = {name: path for package in OURS for name, path in modules(package)}
    graph = {}
    for name, path in known.items():
        targets = set()
        for imported in ours(imports(path)):
            # ``from a.b import c``: the module a.b.c if there is one, else a.b
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_two_modules_import_each_other_however_indirectly():
    graph = module_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles
