"""The other ranks wait for rank 0's export at the end of training as long as it takes (issue 55, item 6): the
export of the best checkpoint (``zero_to_fp32`` over every rank's files) may outlast the process group's timeout,
after which a rank waiting at a plain barrier fails. Two real gloo ranks whose process group times out after 1 s;
rank 0's export takes 3 s."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.train.distributed import on_rank_0


def _rank(rank: int, rdzv: dict, out_dir: str) -> None:
    os.environ.update(rdzv)
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()  # both started before the 1 s group's rendezvous
    while not all(os.path.exists(os.path.join(out_dir, f"ready{r}")) for r in (0, 1)):
        time.sleep(0.01)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    started = time.time()
    on_rank_0(lambda: time.sleep(3))
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{time.time() - started:.1f}")
    dist.destroy_process_group()


def test_the_other_ranks_wait_for_rank_0s_export_past_the_process_groups_timeout(tmp_path):
    # imported here: each spawned rank imports this module, and helpers would cost it seconds
    from helpers import rendezvous

    with rendezvous(2) as rdzv:
        mp.spawn(_rank, args=(rdzv, str(tmp_path)), nprocs=2)
    waited = {rank: float((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)}
    assert waited[1] >= 3.0 and waited[0] >= 3.0, waited
