#!/usr/bin/env bash
# System packages the tests need beyond PyPI: Debian's Chromium renders trace.html headless.
# Installs only what is missing, and only where apt-get can run (root); otherwise it says
# what to install and the HTML test skips with that reason.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the trace.html test"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  echo "note: chromium is not installed; install it (apt-get install chromium) to run the trace.html test" >&2
fi
