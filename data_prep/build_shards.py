"""Tokenize text into webdataset shards with document boundaries, masking plans and MAGNET spans:

    python data_prep/build_shards.py --input 'train/chunk*/example_train_*.jsonl.zst' \
        --tokenizer TOKENIZER_DIR --output shards/ --seq-len 2048 --num-jobs 64 --job-index 0 --workers 8

Also installed as ``pipeline-build-shards``; options: ``--help``. The command line is pipeline/data/prep/build_cli.py,
the build pipeline/data/prep/build.py (docs/data_prep.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.data.prep.build_cli import main

if __name__ == "__main__":
    sys.exit(main())
