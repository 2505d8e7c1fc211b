"""The operator console at the ingress (/console), in a real headless browser
(tests/browser.py), on the shared stack: an operator logs in with the admin token,
creates a team and a key in it, and the key's first request, sent with the openai
SDK, appears in the console's usage (the key's row, the team's usage per model and
the chart), charged to the team too; the console's pages carry no script and
forbid framing."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from browser import click_and_wait, headless_chromium
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"


def test_log_in_create_a_team_and_a_key_and_see_its_first_request_in_usage(base_url, admin_token):
    tag = str(time.monotonic_ns())
    team, key = f"console-{tag}", f"console-key-{tag}"
    with headless_chromium() as driver:
        driver.get(base_url + "/console")
        driver.find_element(By.ID, "credential").send_keys(admin_token)
        click_and_wait(driver, driver.find_element(By.ID, "login"))
        assert driver.find_element(By.TAG_NAME, "h1").text == "Operator console"
        driver.find_element(By.ID, "team-name").send_keys(team)
        click_and_wait(driver, driver.find_element(By.ID, "create-team"))
        assert team in driver.find_element(By.ID, "teams").text
        driver.find_element(By.ID, "key-name").send_keys(key)
        Select(driver.find_element(By.ID, "key-team")).select_by_visible_text(team)
        click_and_wait(driver, driver.find_element(By.ID, "create-key"))
        secret = driver.find_element(By.ID, "new-secret").text

        client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        tokens = answer.usage.total_tokens
        deadline = time.monotonic() + 15  # settlement is off the response's path
        while True:
            driver.get(base_url + "/console")
            row = next(r for r in driver.find_elements(By.CSS_SELECTOR, "#keys tr") if key in r.text)
            cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
            if cells[4] == "1" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert cells[2] == team and cells[4:6] == ["1", str(tokens)], cells
        assert f"{team} {MODEL} 1 {tokens}" in driver.find_element(By.ID, "usage").text
        team_row = next(r for r in driver.find_elements(By.CSS_SELECTOR, "#teams tr") if team in r.text)
        assert [c.text for c in team_row.find_elements(By.TAG_NAME, "td")][4:6] == ["1", str(tokens)]
        assert any(
            team in rect.get_attribute("innerHTML")
            for rect in driver.find_elements(By.CSS_SELECTOR, "#usage-chart rect")
        )
    page = httpx.get(base_url + "/console", timeout=30)
    assert page.status_code == 200 and "<script" not in page.text
    assert (
        page.headers["x-frame-options"] == "DENY"
        and "frame-ancestors 'none'" in page.headers["content-security-policy"]
    )
