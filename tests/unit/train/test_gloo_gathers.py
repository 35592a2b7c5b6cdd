"""DeepSpeed's coalesced ZeRO-3 gathers on gloo: two real CPU ranks, a model built under zero.Init, and all-gathers
that land out of order, as gloo's thread pool may finish them. DeepSpeed up to 0.19.7 waited on the last gather
only, and a rank read parameters before they landed (the project patched it then); 0.19.8, which pyproject.toml
requires, waits on every one. This keeps a DeepSpeed that regresses from going unnoticed (docs/training.md)."""

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


class _Late:
    """An async all-gather whose result lands in its output ``delay`` s after the call; ``wait`` waits for it."""

    def __init__(self, gathered: torch.Tensor, output: torch.Tensor, delay: float):
        self.thread = threading.Thread(target=lambda: (time.sleep(delay), output.copy_(gathered)))
        self.thread.start()

    def wait(self, *args, **kwargs) -> bool:
        self.thread.join()
        return True


def _rank(rank: int, rdzv: dict, out_dir: str) -> None:
    os.environ.update(rdzv, RANK=str(rank), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    world = int(rdzv["WORLD_SIZE"])
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
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


def test_coalesced_gathers_are_complete_when_read_even_if_they_land_out_of_order(tmp_path):
    with rendezvous(2) as rdzv:
        mp.spawn(_rank, args=(rdzv, str(tmp_path)), nprocs=2, join=True)
    gathered_right = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert gathered_right == [[True] * 4] * 2, f"DeepSpeed {deepspeed.__version__} reads ZeRO-3 parameters " \
        "before their gloo gathers land: pin deepspeed>=0.19.8 (docs/training.md)"
