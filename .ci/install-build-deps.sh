#!/usr/bin/env bash
# A C compiler and the headers the optional extensions build against (pyproject.toml's
# ext-modules): OpenSSL's for the bulk plane's native TLS (hybridfleet.ps.wire._tls),
# Python's for both. Without them `pip install` still succeeds and the pure-Python
# fallbacks run, which CI must not silently test instead. Idempotent; Debian/Ubuntu.
set -euo pipefail
PY=${PY:-python3}
have_python_h=$("$PY" -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))))')
if command -v gcc >/dev/null && [ -f /usr/include/openssl/ssl.h ] && [ "$have_python_h" = 1 ]; then
  exit 0
fi
packages="gcc libssl-dev"
[ "$have_python_h" = 1 ] || packages="$packages python3-dev"
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends $packages \
  || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends $packages; }
