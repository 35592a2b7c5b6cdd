"""Embed the texts of pair shards once with a teacher, for the ``distill`` objective:

    python data_prep/teacher_embed.py --shards runs/shards/pairs --model runs/big/hf [--output DIR]

Writes ``teacher.json``, ``keys.npy`` and a ``<column>.npy`` per text column in ``<shards>/teacher`` (or
``--output``); options: ``--help``. The job is pipeline/mining/teacher.py, the files pipeline/data/format/teacher.py
(docs/embedding-recipes.md, "Distillation").
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.mining.teacher import main

if __name__ == "__main__":
    sys.exit(main())
