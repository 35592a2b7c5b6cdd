"""DeepSpeed's coalesced ZeRO-3 gathers on gloo (pipeline.train.gloo_gathers): two real CPU ranks, a model built
under zero.Init, and all-gathers that land out of order, as gloo's thread pool may finish them."""

from __future__ import annotations

import os
import threading
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepspeed import comm
from helpers import rendezvous

from pipeline.train.gloo_gathers import wait_for_every_gather


class _Late:
    """An async all-gather whose result lands in its output ``delay`` s after the call; ``wait`` waits for it."""

    def __init__(self, gathered: torch.Tensor, output: torch.Tensor, delay: float):
        self.thread = threading.Thread(target=lambda: (time.sleep(delay), output.copy_(gathered)))
        self.thread.start()

    def wait(self, *args, **kwargs) -> bool:
        self.thread.join()
        return True


def _rank(rank: int, rdzv: dict, fixed: bool, out_dir: str) -> None:
    os.environ.update(rdzv, RANK=str(rank), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    world = int(rdzv["WORLD_SIZE"])
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    if fixed:
        wait_for_every_gather()
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # every tensor partitioned
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    params = list(model.parameters())
    # what each parameter is: every rank's partition, gathered with plain synchronous all-gathers
    expected = []
    for p in params:
        parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
        dist.all_gather(parts, p.ds_tensor)
        expected.append(torch.cat(parts)[:p.ds_numel].view(p.ds_shape))
    real = comm.all_gather_into_tensor
    launched = []

    def late(output, input_tensor, group=None, async_op=False):
        if not async_op:
            return real(output, input_tensor, group=group)
        gathered = torch.empty_like(output)
        real(gathered, input_tensor, group=group)
        output.fill_(float("nan"))  # not landed yet (torch.empty may reuse memory that held the same values)
        launched.append(output)
        return _Late(gathered, output, delay=1.0 - 0.2 * len(launched))  # the first launched lands last

    comm.all_gather_into_tensor = late
    with deepspeed.zero.GatheredParameters(params):  # one coalesced gather of the four tensors
        seen = [p.detach().clone() for p in params]
    comm.all_gather_into_tensor = real
    time.sleep(1.0)  # the late copies have landed: they must not have changed what the gather returned
    torch.save([bool(torch.equal(s, e)) for s, e in zip(seen, expected)], os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _gathered_right(fixed: bool, tmp_path) -> list[list[bool]]:
    out = tmp_path / ("fixed" if fixed else "plain")
    out.mkdir()
    with rendezvous(2) as rdzv:
        mp.spawn(_rank, args=(rdzv, fixed, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_coalesced_gathers_are_complete_when_read_even_if_they_land_out_of_order(tmp_path):
    plain = _gathered_right(False, tmp_path)
    assert not all(all(r) for r in plain), "DeepSpeed waits on every gather now: gloo_gathers may be dropped"
    assert _gathered_right(True, tmp_path) == [[True] * 4] * 2
