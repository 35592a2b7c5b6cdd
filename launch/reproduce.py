"""Reproduce the three papers' findings at CPU scale on real data, end to end (docs/results.md):

    python launch/reproduce.py [--quick] [--study llm2vec --study mlm_vs_clm --study magnet]
        [--out runs/reproduce] [--results docs/results] [--page docs/results.md]

Needs `make real-data real-model` first (`make reproduce` / `make reproduce-quick` do both). Re-running skips what
is finished and resumes unfinished training runs. Also installed as ``pipeline-reproduce``; the driver is
pipeline/reproduce/driver.py.
"""

import sys

from pipeline.reproduce.driver import main

if __name__ == "__main__":
    sys.exit(main())
