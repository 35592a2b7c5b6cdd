#!/usr/bin/env bash
# The lent GPU's benchmark in one run (<= 8 min on one H100/H200): bench/gpu/run.sh OUT_DIR [bench_gpu.py options];
# see bench_gpu.py.
exec "${PYTHON:-python}" "$(dirname "$0")/bench_gpu.py" --out "${1:?usage: bench/gpu/run.sh OUT_DIR [options]}" "${@:2}"
