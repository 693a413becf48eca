#!/usr/bin/env bash
# Tools the multi-host and pod-by-pod system tests need (tests/netlab.py, tests/k8s_kubelet.py):
# `ip` and `tc` (iproute2), `unshare` and `mount` (util-linux, mount). Safe to re-run.
set -euo pipefail
missing=()
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v unshare >/dev/null || missing+=(util-linux)
command -v mount >/dev/null || missing+=(mount)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get install -y "${missing[@]}" || { apt-get update && apt-get install -y "${missing[@]}"; }
fi
