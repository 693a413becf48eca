#!/usr/bin/env bash
# Data sets the examples and their tests read from the machine (nothing is downloaded at run
# time): Debian's dataset-fashion-mnist for examples/fashion (IDX files under
# /usr/share/datasets/fashion-mnist). Idempotent; Debian/Ubuntu.
set -euo pipefail
if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get install -y --no-install-recommends dataset-fashion-mnist || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends dataset-fashion-mnist; }
