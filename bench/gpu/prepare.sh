#!/usr/bin/env bash
# Builds, here (PyPI needed), what the lent GPU lacks into one git-ignored folder that travels with the working tree
# (the device tool's carry: ["build/gpu-wheels"]): the wheels of bench/gpu/requirements.txt for the GPU's Python
# (cp312, manylinux x86-64), DeepSpeed's built from its sdist without ops. Then bench/gpu/run.sh there installs them.
#   bench/gpu/prepare.sh [--python-version X.Y] [--out DIR]     (defaults: 3.12, build/gpu-wheels)
# --python-version picks the wheels of another Python (tests/e2e/test_gpu_install.py fetches this machine's);
# PYTHON (default .venv/bin/python, else python3) is the pip that builds and downloads.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
python_version=3.12 out=$repo/build/gpu-wheels
while (($#)); do
  case $1 in
    --python-version) python_version=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    *) echo "usage: $0 [--python-version X.Y] [--out DIR]" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-$repo/.venv/bin/python}
[[ -x $python ]] || python=python3

mkdir -p "$out"
rm -f "$out"/*.whl  # exactly the pinned set: a second version of a package would stop the install
downloads=()
while read -r pin; do
  if [[ $pin == deepspeed==* ]]; then
    # no ops (DS_BUILD_OPS=0): pure Python, each op builds on first use there; no cache: a cached build may have ops
    DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-cache-dir --no-binary deepspeed -w "$out" "$pin"
  else
    downloads+=("$pin")
  fi
done < <(sed 's/#.*//; /^[[:space:]]*$/d' "$here/requirements.txt")
"$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$python_version" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${downloads[@]}"
compgen -G "$out/deepspeed-*-py3-none-any.whl" >/dev/null || { echo "prepare.sh: DeepSpeed's wheel is not pure Python" >&2; exit 1; }

# the device tool carries at most 64 MiB: the working tree and this folder together
for f in "$out"/*.whl; do printf '%10d  %s\n' "$(stat -c %s "$f")" "${f##*/}"; done
mib() { awk '{s += $1} END {printf "%.1f", s / 2^20}'; }
wheels=$(stat -c %s "$out"/*.whl | mib)
tree=$(git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && xargs -0 stat -c %s 2>/dev/null || true) | mib)
echo "wheels: $wheels MiB in $out; with the working tree ($tree MiB) of the 64 MiB that travel to the GPU"
awk -v w="$wheels" -v t="$tree" 'BEGIN {exit !(w + t <= 64)}' || { echo "prepare.sh: over the device tool's 64 MiB" >&2; exit 1; }
