"""Train with DeepSpeed: ``deepspeed launch/train.py --config ds_configs/zero3.json [--experiment FILE.yaml] [--set k=v ...]``.

Without ``--experiment`` it runs the embedded default: a tiny Llama-style model trained with CLM on shards of the
sample corpus (built on first use), on CPU in a few minutes. See README.md and docs/training.md.
"""

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.train.distributed import exit_without_teardown
from pipeline.train.entry import main  # light: nothing heavy is imported before the stop signals work

if __name__ == "__main__":
    exit_without_teardown(main())
