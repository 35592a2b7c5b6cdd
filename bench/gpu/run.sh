#!/usr/bin/env bash
# The lent GPU's benchmark in one run (<= 8 min on one H100/H200): bench/gpu/run.sh OUT_DIR [bench_gpu.py options].
# Where prepare.sh's wheels travelled (WHEELS, default build/gpu-wheels; the device tool's carry: ["build/gpu-wheels"])
# it installs them first (install.sh); then it checks the imports and prints the versions (check_stack.py), and only
# then runs bench_gpu.py. PYTHON (default python3) is the interpreter throughout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: bench/gpu/run.sh OUT_DIR [bench_gpu.py options]}
wheels=${WHEELS:-$(dirname "$(dirname "$here")")/build/gpu-wheels}
export PYTHON=${PYTHON:-python3}
if [[ -d $wheels ]]; then
  "$here/install.sh" "$wheels"
fi
"$PYTHON" "$here/check_stack.py"
exec "$PYTHON" "$here/bench_gpu.py" --out "$out" "${@:2}"
