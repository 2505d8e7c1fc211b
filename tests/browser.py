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
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
