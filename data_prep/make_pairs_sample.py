"""Regenerate ``data/sample/pairs/``: a small real (query, positive, hard negative) set made from the sample corpus's
training split by the rule in pipeline/data/prep/pairs_sample.py (speech replies and continuations), for the tests and
the supervised smoke run:

    python data_prep/make_pairs_sample.py [--output data/sample/pairs]
"""

import argparse
import os

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.data.prep.pairs_sample import write_pairs_sample

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=os.path.join(REPO, "data", "sample", "pairs"))
    for path in write_pairs_sample(REPO, p.parse_args().output):
        print(path)
