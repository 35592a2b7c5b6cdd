#!/usr/bin/env bash
# The lent GPU's run in one device call (one command of at most 600 s on one H100/H200, the install included):
#   bench/gpu/run.sh OUT_DIR [ablate.py options]
# Where prepare.sh's wheels travelled (WHEELS, default build/gpu-wheels; the device tool's carry: ["build/gpu-wheels"])
# it installs them first (install.sh); then it checks the imports and prints the versions (check_stack.py), runs the
# smoke test's first checks (smoke.py: each CUDA path the first rows take, on its own), which stop the run only on a
# crash (an exception, a kernel error, a non-finite loss: numerics and timings are reported and the run goes on);
# then the ablation (ablate.py: first its plan of the whole call, then the a-priori best configuration with its
# attribution, the 2026-12-04 configuration, the rest by value and the smoke test's last checks), given the seconds
# this call has run (--elapsed-s: the ablation ends by its CALL_S, 540; ABLATION_S > 0 gives it that many seconds
# instead, ABLATION_S=0 skips it). Last, when USER_S > 0 (default 0: it does not fit the same call after the
# ablation; a second call `ABLATION_S=0 USER_S=110 bench/gpu/run.sh OUT` runs it), the user's own command under
# USER_S seconds: `deepspeed launch/train.py` (DeepSpeed's runner, from this checkout, installed or not) trains the
# 210m preset with MNTP from scratch on the sample corpus at seq 1024, stops at step 20 (a checkpoint), resumes to
# step 40 with validation, and exports the HF directory at the end; its output is OUT_DIR/user-run.log. OUT_DIR
# holds results alone, each file small enough to come back (the trace trimmed to 8 MiB): the compile caches, the
# shards and the user's run directory go to the temporary directory. With --dry-run (on a CPU): the smoke test's
# and the ablation's CPU forms, the plan against the call, nothing more. bench_gpu.py (the per-objective table)
# stays a command of its own. PYTHON (default python3) is the interpreter throughout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
out=${1:?usage: bench/gpu/run.sh OUT_DIR [ablate.py options]}
wheels=${WHEELS:-$repo/build/gpu-wheels}
scratch=${TMPDIR:-/tmp}/bench-gpu
export PYTHON=${PYTHON:-python3}
SECONDS=0  # the call's clock: the ablation's deadline counts from here
if [[ -d $wheels ]]; then
  "$here/install.sh" "$wheels"
fi
"$PYTHON" "$here/check_stack.py"
mkdir -p "$out"
out=$(cd "$out" && pwd)
dry=()
case " ${*:2} " in
  *" --help "*|*" -h "*) exec "$PYTHON" "$here/ablate.py" --help ;;
  *" --dry-run "*) dry=(--dry-run) ;;
esac
if ! "$PYTHON" "$here/smoke.py" "${dry[@]}" 2>&1 | tee "$out/smoke.log"; then
  echo "smoke test: a check crashed (see $out/smoke.log): the ablation and the user's command are not run" >&2
  exit 1
fi
if [[ ${ABLATION_S:-} != 0 ]]; then
  "$PYTHON" "$here/ablate.py" --out "$out" --elapsed-s "$SECONDS" ${ABLATION_S:+--budget-s "$ABLATION_S"} "${@:2}"
fi
if [[ ${#dry[@]} -gt 0 || ${USER_S:-0} == 0 ]]; then  # the user's run is for the GPU, in its own call
  exit 0
fi

# the user's command: train, stop, resume (validated), export
user=(-m deepspeed.launcher.runner --num_gpus 1 "$repo/launch/train.py" --config "$repo/ds_configs/zero3.json"
      --set "run_dir=$scratch/user-run" --set "data.shards=$scratch/shards/sample-1024"
      --set "data.build_inputs=[$repo/data/sample/train/**/*.jsonl.zst]" --set model.init=210m --set model.dtype=bf16
      --set data.seq_len=1024 --set train.micro_batch=8 --set "phases=[{objectives: [{name: mntp, ratio: 0.2}]}]" --set train.steps=40
      --set train.log_every=5 --set checkpoint.every=20 --set eval.every=20 --set eval.holdout=0.02)
rc=0
(cd "$repo" && timeout -k 10 "${USER_S:-110}" bash -c '"$PYTHON" "$@" --set train.stop_at_step=20 && "$PYTHON" "$@"' \
  _ "${user[@]}") >"$out/user-run.log" 2>&1 || rc=$?
echo "user's command (train to 20, stop, resume to 40, export): exit $rc; $(grep -c '^resumed from' "$out/user-run.log" \
  || true) resume(s); HF export: $([[ -f $scratch/user-run/hf/config.json ]] && echo written || echo missing); log: $out/user-run.log"
grep -E '^step +(20|40) ' "$out/user-run.log" || tail -5 "$out/user-run.log"
exit "$rc"
