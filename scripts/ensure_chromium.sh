#!/usr/bin/env bash
# Make sure `chromium` and `chromedriver` are on PATH: the operator console's tests
# drive a real headless browser (tests/browser.py). Installs Debian's packages when
# missing.
set -euo pipefail
command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
fi
echo "chromium and chromedriver are not installed: install them (Debian: apt-get install chromium chromium-driver)" >&2
exit 1
