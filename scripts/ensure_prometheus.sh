#!/usr/bin/env bash
# Make sure a `prometheus` binary is on PATH (the telemetry tests run a real one;
# `make metrics` runs it beside a local stack). Installs Debian's package when
# missing; its service is not started (no init system needed).
set -euo pipefail
command -v prometheus >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  command -v prometheus >/dev/null && exit 0
fi
echo "prometheus is not installed: install it (Debian/Ubuntu: apt-get install prometheus)" >&2
exit 1
