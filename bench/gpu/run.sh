#!/usr/bin/env bash
# The lent GPU's run in one command (<= 8 min on one H100/H200, installs included):
#   bench/gpu/run.sh OUT_DIR [ablate.py options]
# Where prepare.sh's wheels travelled (WHEELS, default build/gpu-wheels; the device tool's carry: ["build/gpu-wheels"])
# it installs them first (install.sh); then it checks the imports and prints the versions (check_stack.py), runs the
# ablation (ablate.py: each lever on and off on the 1b preset, the best config's attribution, the 7b row; its
# --budget-s, default ABLATION_S=300) and last the user's own command on the GPU, under USER_S (default 110) seconds:
# `deepspeed launch/train.py` (DeepSpeed's runner, from this checkout, installed or not) trains the 210m preset with
# MNTP from scratch on the sample corpus at seq 1024, stops at step 20 (a checkpoint), resumes to step 40 with
# validation, and exports the HF directory at the end; its output is OUT_DIR/user-run.log (not with --help or
# ablate.py's --dry-run). bench_gpu.py (the per-objective table) stays a command of its own. PYTHON (default python3) is the interpreter throughout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
out=${1:?usage: bench/gpu/run.sh OUT_DIR [ablate.py options]}
wheels=${WHEELS:-$repo/build/gpu-wheels}
export PYTHON=${PYTHON:-python3}
if [[ -d $wheels ]]; then
  "$here/install.sh" "$wheels"
fi
"$PYTHON" "$here/check_stack.py"
mkdir -p "$out"
out=$(cd "$out" && pwd)
"$PYTHON" "$here/ablate.py" --out "$out" --budget-s "${ABLATION_S:-300}" "${@:2}"
case " ${*:2} " in  # the ablation's usage, or its CPU dry run (the 210m user's run is for the GPU): nothing more
  *" --help "*|*" -h "*|*" --dry-run "*) exit 0 ;;
esac

# the user's command: train, stop, resume (validated), export
user=(-m deepspeed.launcher.runner --num_gpus 1 "$repo/launch/train.py" --config "$repo/ds_configs/zero3.json"
      --set "run_dir=$out/user-run" --set model.init=210m --set model.dtype=bf16 --set data.seq_len=1024
      --set train.micro_batch=8 --set "phases=[{objectives: [{name: mntp, ratio: 0.2}]}]" --set train.steps=40
      --set train.log_every=5 --set checkpoint.every=20 --set eval.every=20 --set eval.holdout=0.02)
rc=0
(cd "$repo" && timeout -k 10 "${USER_S:-110}" bash -c '"$PYTHON" "$@" --set train.stop_at_step=20 && "$PYTHON" "$@"' \
  _ "${user[@]}") >"$out/user-run.log" 2>&1 || rc=$?
echo "user's command (train to 20, stop, resume to 40, export): exit $rc; $(grep -c '^resumed from' "$out/user-run.log" \
  || true) resume(s); HF export: $([[ -f $out/user-run/hf/config.json ]] && echo written || echo missing); log: $out/user-run.log"
grep -E '^step +(20|40) ' "$out/user-run.log" || tail -5 "$out/user-run.log"
exit "$rc"
