#!/bin/bash
# MAGNET of study 3 again with train.seed=1: the spread of its repetition, infilling and STS readings
set -x
cd .
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=2
date
.venv/bin/python launch/sweep.py experiments/reproduce/magnet/grid.yaml --only magnet-magnet --out runs/seed1 --set train.seed=1 --local
date
E=".venv/bin/python launch/evaluate.py --data-dir runs/real --batch-size 8 --no-progress"
FULL="--set sts.max_length=512 --set repetition.max_examples=16 --set repetition.decoding.max_new_tokens=64 --set infilling.generate=0"
$E --model runs/seed1/magnet-magnet --tasks sts,repetition,infilling $FULL --out runs/seed1/magnet-magnet/eval/magnet.json
date
for s in 96 192; do
  $E --model runs/seed1/magnet-magnet --step $s --tasks sts,repetition,infilling $FULL --out runs/seed1/magnet-magnet/eval/step$(printf %08d $s)/magnet.json
  date
done
