#!/usr/bin/env bash
# Installs the Debian packages the build needs, only when something is missing.
# Safe to run again: it does nothing when all is there.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v cc >/dev/null 2>&1 || need+=(build-essential)
pkg-config --exists openblas 2>/dev/null || need+=(libopenblas-openmp-dev)
python3 -c 'import numpy' >/dev/null 2>&1 || pyneed=1
if [ ${#need[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# numpy serves the Python binding's CPU tests; the build itself does not need it.
if [ "${pyneed:-0}" = 1 ] && command -v python3 >/dev/null 2>&1; then
  echo "bootstrap: installing numpy for the Python tests" >&2
  python3 -m pip install -q numpy >/dev/null 2>&1 || echo "bootstrap: numpy not installed; Python tests will be skipped" >&2
fi
