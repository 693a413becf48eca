#!/usr/bin/env bash
# tmux for the terminal test of `hfleet run`'s live view (tests/test_obs_live_tty.py). Idempotent.
set -euo pipefail
command -v tmux >/dev/null && exit 0
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends tmux || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends tmux; }
