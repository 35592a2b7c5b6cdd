"""What a start refuses before it imports torch, transformers and DeepSpeed (5-9 s of a start), so the mistakes of
a run's inputs cost a fraction of a second as a config error does: the run directory (writable, not held by
another run), each packed shard directory's named inputs (present, and what the directory was built from, but for
the tokenizer), and a resume's checkpoint (its links, its global batch, and the shards, LoRA rank and objectives
it was trained with). :func:`~pipeline.train.preflight.local_preflight` makes each again with what the tokenizer
and the model add (another tokenizer, shards still to build, the model's shape, the checkpoint's files scanned):
a check passed here may still refuse there, and none refuses here what would pass there.
"""

from __future__ import annotations

from pipeline.experiment import ExperimentConfig
from pipeline.train.run_setup import check_resumable, check_run_dir, check_run_dir_free, resume_point
from pipeline.train.shard_checks import check_packed_sources, packed_fingerprints


def first_checks(exp: ExperimentConfig, rank: int, world: int | None) -> None:
    """The ConfigError of the first check that fails (the lock on rank 0 alone, as preflight checks it);
    ``world`` None (``--check``, whose ranks the GPUs present decide) leaves the global batch to preflight."""
    check_run_dir(exp.run_dir)
    if rank == 0:
        check_run_dir_free(exp.run_dir)
    to_build = check_packed_sources(exp, None)
    point = resume_point(exp, world, scan=False)
    if point is not None:
        check_resumable(exp, point, None, packed_fingerprints(exp, None, to_build))
