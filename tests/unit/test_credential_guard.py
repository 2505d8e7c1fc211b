"""Whose failed admin credential it is (serve_app/identity/credential_guard.py): the last
X-Forwarded-For entry, the one the edge added after whatever a client forged."""

from starlette.datastructures import Headers

from serve_app.identity.credential_guard import client_of


def test_the_client_is_the_edges_entry_not_one_a_client_forged():
    forged_then_edge = Headers(raw=[(b"x-forwarded-for", b"10.9.9.9"), (b"x-forwarded-for", b"198.51.100.4")])
    assert client_of(forged_then_edge) == "198.51.100.4"
    assert client_of(Headers({"x-forwarded-for": "10.9.9.9, 198.51.100.4 "})) == "198.51.100.4"
    assert client_of(Headers({})) == "unknown"
    assert client_of({"x-forwarded-for": "203.0.113.9"}) == "203.0.113.9"  # a plain dict (the console's)
