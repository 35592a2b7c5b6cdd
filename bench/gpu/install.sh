#!/usr/bin/env bash
# Installs the wheels of bench/gpu/prepare.sh into PYTHON's environment (default python3: on the lent GPU the image's,
# whose torch 2.11 stays): bench/gpu/install.sh WHEELS. No index and no pip configuration, so pip takes nothing but
# WHEELS; it resolves requirements.txt against what is installed and a requirement neither meets fails here instead
# of being fetched. WHEELS holds no torch, and deepspeed's torch>=2.0 is met, so torch is never replaced.
set -euo pipefail
wheels=${1:?usage: bench/gpu/install.sh WHEELS}
unset "${!PIP_@}"  # an index or find-links from the environment would widen the set
PIP_CONFIG_FILE=/dev/null "${PYTHON:-python3}" -m pip install -q --no-index --no-cache-dir --find-links "$wheels" \
  -r "$(dirname "$0")/requirements.txt"
