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


def test_behind_trusted_proxies_the_client_is_the_entry_the_first_untrusted_one_added():
    from ipaddress import ip_network

    trusted = [ip_network("10.0.0.0/8"), ip_network("fd00::/8")]
    # client forged, the real client (as the load balancer saw it), the balancer (as the edge saw it)
    chain = Headers({"x-forwarded-for": "1.2.3.4, 198.51.100.4, 10.1.2.3"})
    assert client_of(chain) == "10.1.2.3"  # no proxy trusted: every client behind the balancer is one
    assert client_of(chain, trusted) == "198.51.100.4"
    assert client_of(Headers({"x-forwarded-for": "10.0.0.1, 10.0.0.2"}), trusted) == "10.0.0.1"  # never past the first
    assert client_of(Headers({"x-forwarded-for": "not-an-address, 10.0.0.2"}), trusted) == "not-an-address"
    assert client_of(Headers({"x-forwarded-for": "2001:db8::1, fd00::5"}), trusted) == "2001:db8::1"


def test_settings_take_networks_and_refuse_a_short_admin_token():
    import pytest
    from pydantic import ValidationError

    from serve_app.settings import MIN_ADMIN_TOKEN_CHARS, AppSettings

    assert AppSettings(auth={"trusted_proxies": ["10.0.0.0/8", "fd00::/8"]}).auth.trusted_proxies
    with pytest.raises(ValidationError, match="trusted_proxies"):
        AppSettings(auth={"trusted_proxies": ["10.0.0.300/8"]})
    with pytest.raises(ValidationError, match=f"at least {MIN_ADMIN_TOKEN_CHARS} characters"):
        AppSettings(admin_token="admin")
    assert AppSettings(admin_token="x" * MIN_ADMIN_TOKEN_CHARS).admin_token is not None
