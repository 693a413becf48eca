#!/usr/bin/env bash
# Installs Prometheus and promtool (Debian's `prometheus` package) for the metrics tests.
# Idempotent. The tests start their own `prometheus` on 127.0.0.1; the packaged
# systemd service is neither needed nor started here.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends prometheus \
    || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends prometheus; }
# Debian's postinst may start the service where systemd runs; the tests do not use it.
command -v systemctl >/dev/null && $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
