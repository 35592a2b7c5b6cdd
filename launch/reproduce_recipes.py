"""Study 4 of docs/results.md, the embedding recipe at CPU scale (issue 52 item 7): Matryoshka, mined negatives and a
merge over three seeds, from the LLM2Vec study's MNTP export:

    python launch/reproduce_recipes.py [--device auto|cuda|cpu] [--results docs/results] [--page docs/results.md]

Needs `make real-data real-model` first. Re-running skips what is finished and resumes unfinished training runs;
the driver is pipeline/reproduce/recipes.py.
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.reproduce.recipes import main

if __name__ == "__main__":
    sys.exit(main())
