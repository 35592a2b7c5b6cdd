"""ZeRO-3 parameter gathers that finish before they are read, on gloo (CPU ranks).

DeepSpeed gathers a list of parameters (``GatheredParameters``: transformers' weight init and checkpoint load under
``zero.Init``, the 16-bit export) with one async all-gather each and then waits on the last one only: on CUDA the
ops run in order on one stream, so the last done means all done. Gloo runs async ops on a pool of threads, out of
order, so a rank could read a parameter before its gather had landed. Measured on 2 CPU ranks: one from-scratch
model in ~7 came out with part of a tensor zero (the embedding, a norm or a projection) on one rank, so the same
config and seed trained to different losses. Here those gathers run one after the other, each complete on return.
"""

from __future__ import annotations

import functools

_PATCHED = False


class _Done:
    """The handle of a collective that has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _synchronous(collective):
    @functools.wraps(collective)
    def call(*args, async_op: bool = False, **kwargs):
        collective(*args, async_op=False, **kwargs)
        return _Done()

    return call


def wait_for_every_gather() -> None:
    """Make DeepSpeed's coalesced parameter gathers synchronous; idempotent. Only for gloo: on NCCL the stream
    order makes DeepSpeed's wait correct and the async launches overlap."""
    global _PATCHED
    if _PATCHED:
        return
    from deepspeed import comm
    from deepspeed.runtime.zero.partition_parameters import Init

    coalesced = Init._allgather_params_coalesced

    @functools.wraps(coalesced)
    def gather_then_wait(self, *args, **kwargs):
        gathers = comm.all_gather_into_tensor, comm.all_gather
        comm.all_gather_into_tensor, comm.all_gather = (_synchronous(g) for g in gathers)
        try:
            return coalesced(self, *args, **kwargs)
        finally:
            comm.all_gather_into_tensor, comm.all_gather = gathers

    Init._allgather_params_coalesced = gather_then_wait
    _PATCHED = True
