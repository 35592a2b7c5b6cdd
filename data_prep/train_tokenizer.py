"""Train a sentencepiece BPE tokenizer for from-scratch runs and save it as an HF tokenizer directory:

    python data_prep/train_tokenizer.py --input 'data/sample/train/chunk*/example_train_*.jsonl.zst' \
        --vocab-size 8000 --output data/sample/tokenizer

Also installed as ``pipeline-train-tokenizer``; options: ``--help``. The training is
pipeline/data/prep/tokenizer_training.py (docs/data_prep.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.data.prep.tokenizer_training import main

if __name__ == "__main__":
    sys.exit(main())
