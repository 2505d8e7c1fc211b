"""Every route the ingress serves declares who may call it, and only probes go without a key."""

from serve_app.http.ingress import ROUTE_ACCESS, app


def served_routes() -> set[tuple[str, str]]:
    return {(method, route.path) for route in app.routes for method in route.methods}


def test_every_served_route_is_declared_and_nothing_else():
    assert served_routes() == set(ROUTE_ACCESS)


def test_only_probes_are_unauthenticated():
    public = {path for (_, path), kind in ROUTE_ACCESS.items() if kind == "probe"}
    assert public == {"/health", "/ready", "/ping"}
    assert set(ROUTE_ACCESS.values()) == {"probe", "key", "admin", "console"}
    # The console's pages ask for its session (an admin credential at its login form).
    assert {path for (_, path), kind in ROUTE_ACCESS.items() if kind == "console"} == {
        "/console",
        "/console/login",
        "/console/logout",
        "/console/teams",
        "/console/keys",
        "/console/keys/{key}/revoke",
        "/console/keys/{key}/limits",
    }


def test_no_schema_or_docs_route_is_served():
    assert app.openapi_url is None and app.docs_url is None and app.redoc_url is None
