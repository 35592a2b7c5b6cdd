#!/usr/bin/env bash
# The lent GPU's run in one device call (<= 10 min on one H100/H200, installs included):
#   bench/gpu/run.sh OUT_DIR [ablate.py options]
# Where prepare.sh's wheels travelled (WHEELS, default build/gpu-wheels; the device tool's carry: ["build/gpu-wheels"])
# it installs them first (install.sh); then it checks the imports and prints the versions (check_stack.py), runs the
# smoke test (smoke.py, <= 90 s: each CUDA path on its own) and stops there on a failure, before the costly rows;
# then the ablation (ablate.py: the levers in the order of their value, the best config's attribution, the rest and
# the 7b row; its --budget-s, default ABLATION_S=390; 0 skips it); last, when USER_S > 0 (default 0: it does not fit
# the same call after the ablation; a second call `ABLATION_S=0 USER_S=110 bench/gpu/run.sh OUT` runs it), the
# user's own command under USER_S seconds: `deepspeed launch/train.py` (DeepSpeed's runner, from this checkout,
# installed or not) trains the 210m preset with MNTP from scratch on the sample corpus at seq 1024, stops at step 20
# (a checkpoint), resumes to step 40 with validation, and exports the HF directory at the end; its output is
# OUT_DIR/user-run.log; its shards are built into OUT_DIR/shards. The inductor and Triton caches live under OUT_DIR (TORCHINDUCTOR_CACHE_DIR,
# TRITON_CACHE_DIR), shared by the rows. With --dry-run (on a CPU): the smoke test's and the ablation's CPU forms,
# the plan's expected seconds against the budget, nothing more. bench_gpu.py (the per-objective table) stays a command
# of its own. PYTHON (default python3) is the interpreter throughout.
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
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$out/inductor-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$out/triton-cache}
dry=()
case " ${*:2} " in
  *" --help "*|*" -h "*) exec "$PYTHON" "$here/ablate.py" --help ;;
  *" --dry-run "*) dry=(--dry-run) ;;
esac
if ! "$PYTHON" "$here/smoke.py" "${dry[@]}" 2>&1 | tee "$out/smoke.log"; then
  echo "smoke test failed (see $out/smoke.log): the ablation and the user's command are not run" >&2
  exit 1
fi
if [[ ${ABLATION_S:-390} != 0 ]]; then
  "$PYTHON" "$here/ablate.py" --out "$out" --budget-s "${ABLATION_S:-390}" "${@:2}"
fi
if [[ ${#dry[@]} -gt 0 || ${USER_S:-0} == 0 ]]; then  # the user's run is for the GPU, in its own call
  exit 0
fi

# the user's command: train, stop, resume (validated), export
user=(-m deepspeed.launcher.runner --num_gpus 1 "$repo/launch/train.py" --config "$repo/ds_configs/zero3.json"
      --set "run_dir=$out/user-run" --set "data.shards=$out/shards/sample-1024"
      --set "data.build_inputs=[$repo/data/sample/train/**/*.jsonl.zst]" --set model.init=210m --set model.dtype=bf16
      --set data.seq_len=1024 --set train.micro_batch=8 --set "phases=[{objectives: [{name: mntp, ratio: 0.2}]}]" --set train.steps=40
      --set train.log_every=5 --set checkpoint.every=20 --set eval.every=20 --set eval.holdout=0.02)
rc=0
(cd "$repo" && timeout -k 10 "${USER_S:-110}" bash -c '"$PYTHON" "$@" --set train.stop_at_step=20 && "$PYTHON" "$@"' \
  _ "${user[@]}") >"$out/user-run.log" 2>&1 || rc=$?
echo "user's command (train to 20, stop, resume to 40, export): exit $rc; $(grep -c '^resumed from' "$out/user-run.log" \
  || true) resume(s); HF export: $([[ -f $out/user-run/hf/config.json ]] && echo written || echo missing); log: $out/user-run.log"
grep -E '^step +(20|40) ' "$out/user-run.log" || tail -5 "$out/user-run.log"
exit "$rc"
