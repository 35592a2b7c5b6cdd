"""Evaluate a run or an HF model on evaluation tasks and write the results as JSON:
``python launch/evaluate.py --model RUN_DIR|HF_DIR --tasks sts,repetition --data-dir DIR [--out results.json] ...``
(options: ``pipeline.eval.runner.main``; tasks and data: docs/evaluation.md)."""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.eval.runner import main

if __name__ == "__main__":
    sys.exit(main())
