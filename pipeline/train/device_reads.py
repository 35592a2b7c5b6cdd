"""Every read of the device's values back to the host in a region of code, by whoever makes it (the project,
transformers, DeepSpeed, torch): each waits for everything queued on the device, so one in a training step leaves
the GPU idle while the host catches up. tests/unit/train/test_host_reads.py counts a step's; bench/gpu/smoke.py counts
them on the GPU (docs/training.md "Device reads").

On a GPU a read is an op that needs a device value on the host: ``_local_scalar_dense`` (``item``, ``bool``,
``int``, ``float`` of a tensor, a Python ``if`` on one), ``nonzero`` (a boolean index, ``torch.where`` of one
argument), ``is_nonzero``, and a copy to the CPU that the host waits for (not a non-blocking one into pinned memory:
``_copies_to_host``); ``tolist`` / ``numpy`` of a device tensor go through such a copy.
On the CPU, where the tests run, device and host are one, so the same ops count for every tensor but the given
``host`` ones (the loader's copy of the batch, which the host owns), and ``tolist`` / ``numpy`` / ``cpu`` count too:
they read no device there, but would on a GPU."""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default}
HOST_VIEWS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}  # no aten op on a CPU tensor
_TORCH = os.sep + "torch" + os.sep


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def caller() -> str:
    """``package/path.py:line`` of the innermost frame outside torch and this module, who asked for the read: a
    library's path from its package (``deepspeed/runtime/...``), the checkout's from its root (``pipeline/...``)."""
    frame = sys._getframe(2)
    while frame is not None and (_TORCH in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    parts = path.split(os.sep)
    packages = [i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")]
    where = os.sep.join(parts[packages[-1] + 1:]) if packages else os.path.relpath(path, _ROOT)
    return f"{where}:{frame.f_lineno}"


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


class DeviceReads(ExitStack):
    """``with DeviceReads(host=tensors) as reads:``; ``reads.sites`` counts the reads by :func:`caller`,
    ``reads.total`` sums them. ``cpu_is_device`` (default: where there is no CUDA) counts reads of CPU tensors as
    device reads, except those of ``host``, the tensors the host owns."""

    def __init__(self, host=(), cpu_is_device: bool | None = None):
        super().__init__()
        self.sites: Counter = Counter()
        self._host = {id(t) for t in host}
        emulate = not torch.cuda.is_available() if cpu_is_device is None else cpu_is_device
        counter = self

        def counted(t) -> bool:
            return _on_device(t) or (emulate and isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                     and id(t) not in counter._host)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in READ_OPS and args and counted(args[0]):
                    counter.sites[caller()] += 1
                elif func in COPY_OPS and _copies_to_host(func, args, kwargs):
                    counter.sites[caller()] += 1
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in HOST_VIEWS and emulate and args and counted(args[0]):
                    counter.sites[caller()] += 1
                return func(*args, **(kwargs or {}))

        self._modes = (Function(), Dispatch())

    def __enter__(self) -> DeviceReads:
        super().__enter__()
        for mode in self._modes:
            self.enter_context(mode)
        return self

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _copies_to_host(func, args, kwargs) -> bool:
    """A device tensor copied into host memory (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor) in a copy
    the host waits for. A non-blocking copy into pinned memory is queued and returns: the host reads its values
    later, once an event says they are there (the step's numbers: ``pipeline.train.step.StepResult``), and
    ``.to("cpu", non_blocking=True)`` pins its output itself. Into pageable memory CUDA copies synchronously,
    whatever ``non_blocking`` says."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return (_on_device(args[0]) and device is not None and torch.device(device).type == "cpu"
                and not kwargs.get("non_blocking", False))
    if not (len(args) > 1 and _on_device(args[1]) and args[0].device.type == "cpu"):
        return False
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return not (non_blocking and args[0].is_pinned())
