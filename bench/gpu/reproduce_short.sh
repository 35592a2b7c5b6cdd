#!/usr/bin/env bash
# The MLM-vs-CLM study at `launch/reproduce.py --scale gpu-short` on the lent GPU in one run (<= 8 min on one H200,
# the install included; docs/results.md "GPU short scale"):
#   bench/gpu/reproduce_short.sh --prepare       here, with PyPI: the wheels (prepare.sh) and runs/real, checked
#   bench/gpu/reproduce_short.sh OUT             there; the device tool's carry: ["build/gpu-wheels", "runs/real"]
#   bench/gpu/reproduce_short.sh --dry-run OUT   anywhere: the imports and the driver's --dry-run plan, no install
# --prepare builds build/gpu-wheels when it holds none (prepare.sh), extracts runs/real from `make real-data`'s
# downloads (pipeline/reproduce/data.py) and prints what travels: the scale's inputs (the driver's "inputs:" line,
# <= 40 MB) and the working tree with both carried folders (<= the tool's 64 MiB). There it installs the wheels
# where they travelled (install.sh), checks the imports and prints the versions (check_stack.py), then runs the
# driver on the GPU under a deadline (BUDGET_S, default 540 s: a cut run still leaves its logs) and packs, whatever
# happened, into OUT: gpu-short.tar.gz (docs/results.md with the generated gpu-short block, docs/results/gpu-short/
# and the run directories' small files, no checkpoints: untar it at the repository root), reproduce.log (all
# output) and gpu.txt (nvidia-smi). PYTHON (default python3) is the interpreter throughout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
export PYTHON=${PYTHON:-python3}
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
wheels=${WHEELS:-$repo/build/gpu-wheels}
runs=runs/reproduce-gpu-short
usage="usage: $0 --prepare | $0 OUT | $0 --dry-run OUT"
cd "$repo"

mib() { awk '{s += $1} END {printf "%.1f", s / 2^20}'; }

prepare() {
  compgen -G "$wheels/*.whl" >/dev/null || "$here/prepare.sh" --out "$wheels"
  "$PYTHON" -c 'from pipeline.reproduce.data import extract, is_extracted
is_extracted("runs/real") or extract("runs/downloads", "runs/real")'
  "$PYTHON" launch/reproduce.py --scale gpu-short --dry-run | grep '^device: '
  local tree carried
  tree=$(git ls-files -z --cached --others --exclude-standard | (xargs -0 stat -c %s 2>/dev/null || true) | mib)
  carried=$(du -sb "$wheels" runs/real | mib)
  echo "travels: the working tree $tree MiB + build/gpu-wheels and runs/real $carried MiB (the tool's limit: 64 MiB)"
  awk -v t="$tree" -v c="$carried" 'BEGIN {exit !(t + c <= 64)}' || { echo "$0: over the tool's 64 MiB" >&2; exit 1; }
}

run() {
  local out=$1 rc=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1 || true
  if [[ -d $wheels ]]; then
    "$here/install.sh" "$wheels"
  fi
  "$PYTHON" "$here/check_stack.py" pipeline.reproduce.driver
  SECONDS=0
  timeout -k 30 "${BUDGET_S:-540}" "$PYTHON" launch/reproduce.py --scale gpu-short --device cuda || rc=$?
  echo "reproduce_short.sh: the driver exited with $rc after $SECONDS s"
  # the records: small files only (a run's checkpoints and HF export stay behind)
  { find docs/results.md docs/results/gpu-short $runs -type f -size -2M -print0 2>/dev/null || true; } |
    tar --null -czf "$out/gpu-short.tar.gz" -T -
  echo "reproduce_short.sh: packed $(tar -tzf "$out/gpu-short.tar.gz" | wc -l) files into $out/gpu-short.tar.gz"
  return "$rc"
}

dry_run() {
  "$PYTHON" "$here/check_stack.py" pipeline.reproduce.driver
  "$PYTHON" launch/reproduce.py --scale gpu-short --dry-run | tee "$1/plan.txt"
}

case ${1:-} in
  --prepare) (($# == 1)) || { echo "$usage" >&2; exit 2; }; prepare ;;
  --dry-run) (($# == 2)) || { echo "$usage" >&2; exit 2; }; mkdir -p "$2"; dry_run "$2" ;;
  ""|-*) echo "$usage" >&2; exit 2 ;;
  *) (($# == 1)) || { echo "$usage" >&2; exit 2; }
     mkdir -p "$1"; out=$(cd "$1" && pwd)
     run "$out" 2>&1 | tee "$out/reproduce.log"; exit "${PIPESTATUS[0]}" ;;
esac
