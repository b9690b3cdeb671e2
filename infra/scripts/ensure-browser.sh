#!/usr/bin/env bash
# Make sure Debian's headless Chromium is present for the console's browser tests
# (Playwright drives it through executable_path; we never download a browser bundle).
# Installs it with apt-get when missing and running as root; otherwise says what to do.
set -euo pipefail

CHROMIUM=${TOLLGATE_CHROMIUM:-/usr/bin/chromium}

say() { echo "browser: $*"; }

if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "browser: $CHROMIUM is missing. Install it: sudo apt-get install -y chromium" >&2
  exit 1
fi
say "installing chromium with apt-get"
DEBIAN_FRONTEND=noninteractive apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
[ -x "$CHROMIUM" ] || { echo "browser: chromium installed but $CHROMIUM is absent" >&2; exit 1; }
say "chromium ready: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
