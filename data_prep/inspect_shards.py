"""Verify a shard directory against its manifests, print its statistics and show one sample as text:

    python data_prep/inspect_shards.py shards/ --sample 0 --ratio 0.3 --policy 80-10-10

Also installed as ``pipeline-inspect-shards``; options: ``--help``. The checks are pipeline/data/prep/inspection.py
(docs/data_prep.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.data.prep.inspection import main

if __name__ == "__main__":
    sys.exit(main())
