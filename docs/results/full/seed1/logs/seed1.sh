#!/bin/bash
# LLM2Vec's MNTP -> SimCSE chain of study 1 again with train.seed=1: the spread of the headline STS-B claim
set -x
cd .
export DS_ACCELERATOR=cpu
date
.venv/bin/python launch/sweep.py experiments/reproduce/llm2vec/grid.yaml --only llm2vec-mntp --only llm2vec-simcse --out runs/seed1 --set train.seed=1 --local
date
E=".venv/bin/python launch/evaluate.py --tasks sts --data-dir runs/real --set sts.max_length=512 --batch-size 8 --no-progress"
$E --model runs/seed1/llm2vec-simcse
date
$E --model runs/seed1/llm2vec-mntp
date
$E --model runs/seed1/llm2vec-simcse --step 96
date
