#!/usr/bin/env bash
# PostgreSQL server binaries for the registry tests (tests/postgres.py starts a private
# server on 127.0.0.1 per test session). Idempotent; Debian/Ubuntu.
set -euo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends postgresql || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends postgresql; }
# Debian starts a cluster on install; the tests run their own, so stop it.
$SUDO service postgresql stop >/dev/null 2>&1 || true
