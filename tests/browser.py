"""A real headless browser for tests of web pages: Debian's chromium driven by
Selenium through Debian's chromedriver (scripts/ensure_chromium.sh installs both).
Nothing is downloaded: Selenium Manager is kept offline and told where both are."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@contextlib.contextmanager
def headless_chromium() -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Root in a container: no sandbox; /dev/shm is small there.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def click_and_wait(driver, element, timeout_s: float = 30) -> None:
    """Click what submits a form and wait for the next page, loaded: a click returns
    before the browser has navigated, and the old page would still answer the next lookup."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")

    def next_page_loaded(_) -> bool:
        try:
            old.is_enabled()  # raises once the old document is gone
            return False
        except WebDriverException:  # stale, or Chromium's "node does not belong to the document"
            return driver.execute_script("return document.readyState") == "complete"

    element.click()
    WebDriverWait(driver, timeout_s).until(next_page_loaded)
