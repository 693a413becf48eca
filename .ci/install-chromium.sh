#!/usr/bin/env bash
# Installs headless Chromium (Debian's `chromium` package) for the browser tests of
# `hfleet report` and `hfleet ui`; Playwright drives it via executable_path. Idempotent.
set -euo pipefail
if command -v chromium >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core \
    || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core; }
