#!/bin/bash
# Study 3's LLM2Vec side with train.seed=1: the MNTP -> SimCSE chain of docs/results/full/seed1 trained again (the same
# seed gives the same losses) and read on study 3's repetition and infilling tasks, at chain steps 192 and 240.
set -x
cd .
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=2

date
.venv/bin/python launch/sweep.py experiments/reproduce/llm2vec/grid.yaml --only llm2vec-mntp --only llm2vec-simcse --out runs/seed1 --set train.seed=1 --local
date
E=".venv/bin/python launch/evaluate.py --data-dir runs/real --batch-size 8 --no-progress --tasks repetition,infilling"
FULL="--set repetition.max_examples=16 --set repetition.decoding.max_new_tokens=64 --set infilling.generate=0"
$E --model runs/seed1/llm2vec-simcse $FULL --out runs/seed1/llm2vec-simcse/eval/magnet.json
date
$E --model runs/seed1/llm2vec-simcse --step 144 $FULL --out runs/seed1/llm2vec-simcse/eval/step00000144/magnet.json
date
