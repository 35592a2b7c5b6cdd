"""Mine hard negatives for (query, positive) pairs with any export, filtered as sentence-transformers'
mine_hard_negatives filters them (range_min, range_max, relative_margin, absolute_margin, max_score):

    python data_prep/mine_negatives.py --input 'data/sample/pairs/*.jsonl' --model runs/simcse/hf \
        --output runs/mined --num-negatives 3 --range-min 2 --relative-margin 0.05
    torchrun --standalone --nproc-per-node 2 data_prep/mine_negatives.py ...   # encoded across 2 ranks, same bytes

Also installed as ``pipeline-mine-negatives``; options: ``--help``. The command line and the job are
pipeline/mining/cli.py, the search and filters pipeline/mining/negatives.py (docs/embedding-recipes.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.mining.cli import main

if __name__ == "__main__":
    sys.exit(main())
