"""The operator console (serve_app/http/console.py) in a real headless browser
(tests/browser.py) against a real Redis: the console's pages served by uvicorn
with the same ``Console`` the ingress routes to (the ingress' own routes are
driven end to end in tests/e2e/shared_stack/test_console_e2e.py). Log in, create
a team and a key, see the key's first request in the usage; a wrong credential,
a form from another site, a revoked admin's session; an identity token's user
listed with its usage."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import httpx
import pytest
import uvicorn
from browser import click_and_wait, headless_chromium
from ports import free_port
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select
from starlette.applications import Starlette
from starlette.routing import Route

from serve_app.admin import operations as admin
from serve_app.http.console import Console
from serve_app.http.services import QuotaServices, build_quota_services
from serve_app.identity.keys import KeyRecord
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

ADMIN_TOKEN = "console-test-admin-token-of-32-chars"


@pytest.fixture
def console_url(redis_server):
    """The console's routes on a server of their own, on the session's one-node Redis
    (its quota services used on the server's loop only; the test reads Redis with its own)."""
    services = make_access(redis_server.url)
    console = Console(services.authenticator, services.stores)

    # As the ingress' ``console`` routes run them: the session read first (route_access.py).
    def act(action):
        async def handler(request):
            return await console.act(
                request, await console.session_admin(request), action, request.path_params.get("key", "")
            )

        return handler

    async def page(request):
        return await console.page(request, await console.session_admin(request))

    app = Starlette(
        routes=[
            Route("/console", page),
            Route("/console/login", console.login, methods=["POST"]),
            Route("/console/logout", console.logout, methods=["POST"]),
            Route("/console/teams", act("team"), methods=["POST"]),
            Route("/console/keys", act("key"), methods=["POST"]),
            Route("/console/keys/{key}/revoke", act("revoke"), methods=["POST"]),
            Route("/console/keys/{key}/limits", act("limits"), methods=["POST"]),
        ]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", redis_server.url
    server.should_exit = True
    thread.join(timeout=10)


def make_access(redis_url: str) -> QuotaServices:
    return build_quota_services(AppSettings(redis_url=redis_url, admin_token=ADMIN_TOKEN), Telemetry(False, False))


def aside(redis_url: str, work):
    """``await work(access)`` with quota services of the test's own (its own loop and connections)."""

    async def run():
        access = make_access(redis_url)
        try:
            return await work(access)
        finally:
            await access.redis.aclose()

    return asyncio.run(run())


def log_in(driver, url: str, credential: str) -> None:
    driver.get(url + "/console")
    driver.find_element(By.ID, "credential").send_keys(credential)
    click_and_wait(driver, driver.find_element(By.ID, "login"))


async def charge_one_request(access: QuotaServices, key_id: str) -> None:
    """What the ingress does for one request of the key: admitted, then settled."""
    ticket = await access.gate.admit(await access.stores.keys.get(key_id), "tiny-llama", 20)
    for level in ticket.levels():
        await access.gate.admission.settle(level, ticket.request_id, "completed", 5, 7, "", "tiny-llama")


def test_an_operator_logs_in_makes_a_team_and_a_key_and_sees_its_first_request(console_url):
    url, redis_url = console_url
    tag = str(time.monotonic_ns())
    with headless_chromium() as driver:
        log_in(driver, url, "not-a-credential")
        assert "That is not an admin credential." in driver.page_source
        log_in(driver, url, ADMIN_TOKEN)
        assert driver.find_element(By.TAG_NAME, "h1").text == "Operator console"

        driver.find_element(By.ID, "team-name").send_keys(f"console-team-{tag}")
        driver.find_element(By.CSS_SELECTOR, "form[action='/console/teams'] input[name=requests_per_minute]").send_keys(
            "50"
        )
        click_and_wait(driver, driver.find_element(By.ID, "create-team"))
        teams = driver.find_element(By.ID, "teams").text
        assert f"console-team-{tag}" in teams and "50/min" in teams

        driver.find_element(By.ID, "key-name").send_keys(f"console-key-{tag}")
        Select(driver.find_element(By.ID, "key-team")).select_by_visible_text(f"console-team-{tag}")
        click_and_wait(driver, driver.find_element(By.ID, "create-key"))
        secret = driver.find_element(By.ID, "new-secret").text
        assert secret.startswith("sk-llm-")
        key = next(k for k in aside(redis_url, lambda a: a.stores.keys.list()) if k.name == f"console-key-{tag}")
        assert aside(redis_url, lambda a: a.stores.keys.authenticate(secret)).id == key.id and key.team is not None

        aside(redis_url, lambda a: charge_one_request(a, key.id))
        driver.get(url + "/console")
        row = next(r for r in driver.find_elements(By.CSS_SELECTOR, "#keys tr") if f"console-key-{tag}" in r.text)
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[4:6] == ["1", "12"]  # requests and tokens today
        usage = driver.find_element(By.ID, "usage").text
        assert f"console-team-{tag} tiny-llama 1 12" in usage
        assert driver.find_element(By.ID, "usage-chart").find_elements(By.TAG_NAME, "rect")
        audit = driver.find_element(By.ID, "audit").text
        assert "key.create" in audit and "team.create" in audit and "admin-token" in audit

        click_and_wait(driver, driver.find_element(By.ID, f"revoke-{key.id}"))
        assert aside(redis_url, lambda a: a.stores.keys.get(key.id)).enabled is False
        click_and_wait(driver, driver.find_element(By.CSS_SELECTOR, "header button"))  # log out
        driver.get(url + "/console")
        assert driver.find_elements(By.ID, "credential")


def test_a_form_from_another_site_and_a_revoked_admins_session_do_nothing(console_url):
    url, redis_url = console_url
    name = f"ops-{time.monotonic_ns()}"
    made = aside(redis_url, lambda a: admin.create_admin(a.stores, {"name": name}, "admin-token"))
    with httpx.Client(base_url=url, follow_redirects=False) as http:
        # Login CSRF: another site logging the victim's browser into the attacker's session.
        planted = http.post(
            "/console/login", data={"credential": made["secret"]}, headers={"origin": "http://evil.example"}
        )
        assert planted.status_code == 403 and "llm_console" not in http.cookies
        assert http.post("/console/login", data={"credential": made["secret"]}).status_code == 303
        assert "llm_console" in http.cookies
        forged = http.post(
            "/console/teams", data={"name": f"forged-{name}"}, headers={"origin": "https://evil.example"}
        )
        assert forged.status_code == 403
        assert f"forged-{name}" not in [t.name for t in aside(redis_url, lambda a: a.stores.teams.list())]
        assert http.get("/console").text.count("Log out") == 1
        aside(redis_url, lambda a: admin.revoke_admin(a.stores, name, "admin-token"))
        assert "credential" in http.get("/console").text  # the session ended with its admin
        assert http.post("/console/teams", data={"name": f"late-{name}"}).status_code == 303
        assert f"late-{name}" not in [t.name for t in aside(redis_url, lambda a: a.stores.teams.list())]


async def charge_a_token_user(access: QuotaServices, sub: str) -> str:
    """An identity token's user admitted and charged as the ingress would; its id."""
    user = KeyRecord(id="j" + hashlib.sha256(sub.encode()).hexdigest()[:16], name=f"jwt:{sub}", created_at=0)
    ticket = await access.gate.admit(user, "tiny-llama", 20)
    for level in ticket.levels():
        await access.gate.admission.settle(level, ticket.request_id, "completed", 5, 7, "", "tiny-llama")
    await asyncio.sleep(0.5)  # the user's entry is written in a later pipeline turn
    return user.id


def test_an_identity_tokens_user_is_listed_with_its_usage(console_url):
    url, redis_url = console_url
    sub = f"ana-{time.monotonic_ns()}@example.com"
    user_id = aside(redis_url, lambda a: charge_a_token_user(a, sub))
    with headless_chromium() as driver:
        log_in(driver, url, ADMIN_TOKEN)
        row = next(r for r in driver.find_elements(By.CSS_SELECTOR, "#token-users tr") if f"jwt:{sub}" in r.text)
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[1] == user_id and cells[3:5] == ["1", "12"]  # requests and tokens today
