"""Every read of the device in a training step, by whoever makes it (the project, transformers, torch): counted by
``pipeline.train.device_reads.DeviceReads`` (a dispatch mode on ``_local_scalar_dense``, ``nonzero``,
``is_nonzero`` and copies to the CPU, plus ``tolist`` / ``numpy`` / ``cpu``), here on the CPU, where every tensor but
the loader's host copy of the batch stands for a device tensor. Target: none per micro-step; what remains is listed
in docs/training.md "Device reads"."""

from __future__ import annotations

import os
from dataclasses import fields

import pytest
import torch
import torch.distributed as dist
from helpers import packed_text_batch, unit_text_batch
from torch.utils._pytree import tree_map

from pipeline.config import from_dict
from pipeline.data.loading.batch import Batch
from pipeline.experiment import SAMPLE_DIR, PhaseSpec
from pipeline.model.attention import FLEX, attention_inputs
from pipeline.model.build import build_model, model_spec
from pipeline.tokenizer import load_tokenizer
from pipeline.train.device_reads import DeviceReads
from pipeline.train.module import TrainModule
from pipeline.train.phases import build_objectives
from pipeline.train.step import target_counts, train_step


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """A world of one (``train_step`` all-reduces the step's sums)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


TEXTS = ["The river rises in the hills and flows south to the sea.", "Now is the winter of our discontent.",
         "A short one.", "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day."]


class Engine:
    """What ``train_step`` calls on a DeepSpeed engine, with torch's fused AdamW step (the CUDA default; it reads
    nothing; DeepSpeed's own reads are its optimizer step's: docs/training.md)."""

    def __init__(self, module: TrainModule):
        self.module, self.optimizer = module, torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
        self.boundary = True

    def set_gradient_accumulation_boundary(self, boundary: bool):
        self.boundary = boundary

    def __call__(self, objective, batch, *counts):
        return self.module(objective, batch, *counts)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if self.boundary:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def get_lr(self):
        return [self.optimizer.param_groups[0]["lr"]]

    def get_global_grad_norm(self):
        return None


def host_tensors(batches: list[Batch]) -> list[torch.Tensor]:
    return [getattr(b, f.name) for b in batches for f in fields(b) if isinstance(getattr(b, f.name), torch.Tensor)]


def counted_step(monkeypatch, spec: dict, batches: list[Batch], kind: str, attention_dropout: float = 0.0,
                 sources: tuple[str, ...] = ()) -> tuple[DeviceReads, list[int]]:
    """(the device reads, the size of each all-reduce) of one step of ``spec`` on ``batches``."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    objectives = build_objectives(from_dict(PhaseSpec, spec), tokenizer)
    torch.manual_seed(0)
    lm = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
                     eos_token_id=tokenizer.eos_id))
    for module in lm.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = attention_dropout
    for o in objectives:
        o.objective.attach(lm)
    by_kind = {kind: batches}
    counts = target_counts(objectives, by_kind)  # on the host copies, as the trainer does
    engine = Engine(TrainModule(lm))
    reduced = []

    def all_reduce(tensor, *args, real=dist.all_reduce, **kwargs):
        reduced.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with DeviceReads(host=host_tensors(batches)) as reads:
        result = train_step(engine, objectives, by_kind, 1, len(batches), sources, counts)
    assert all(loss == loss for loss in result.losses.values())  # the step ran (read afterwards: not counted)
    assert set(result.source_losses) == (set(result.losses) if sources else set())
    return reads, reduced


def test_a_packed_step_reads_nothing_and_reduces_twice(monkeypatch):
    """CLM, MNTP and MAGNET, two micro-batches of two sources: no read of the device at all (the mask decision and
    the varlen segments come from the host copy, the target counts from the host, the results leave in one
    non-blocking copy that is read after the step), and two all-reduces: the target counts and work before the
    forward, every logged sum (per output and per source) after the step."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    batches = [packed_text_batch(tokenizer, TEXTS * 2), packed_text_batch(tokenizer, TEXTS * 2, seed=1)]
    for b in batches:
        b.source_ids = torch.tensor([0, 1, 1, 0])
    spec = {"objectives": [{"name": "clm"}, {"name": "mntp"}, {"name": "magnet", "log_as": "magnet"}]}
    reads, reduced = counted_step(monkeypatch, spec, batches, "packed", sources=("a", "b"))
    assert dict(reads.sites) == {}
    # 4 outputs: 4 target counts + 3 of work; 4 x (loss, correct) + 4 x 2 sources x (loss, targets) + 2 tokens
    assert reduced == [4 + 3, 4 * 2 + 4 * 2 * 2 + 2]


def test_a_simcse_step_reads_nothing(monkeypatch):
    """SimCSE's unit check and its rows with text are decided on the host copy (a boolean index or ``bool(any)`` of
    the device's batch was a read a micro-batch)."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    batches = [unit_text_batch(tokenizer, TEXTS), unit_text_batch(tokenizer, TEXTS[::-1], first_index=4)]
    reads, reduced = counted_step(monkeypatch, {"objectives": [{"name": "simcse"}]}, batches, "units",
                                  attention_dropout=0.1)
    assert dict(reads.sites) == {} and len(reduced) == 2


def test_transformers_mask_code_reads_nothing_under_our_implementations():
    """A batch that needs no mask: under SDPA transformers' mask preprocessing reads the device once a forward
    (``find_packed_sequence_indices``' ``bool`` of its position-id check); under FLEX / VARLEN the empty 4D mask
    (``attention.no_mask``) makes it return the mask as it is, and nothing is read."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    ids = torch.randint(10, 100, (2, 16))
    doc_ids = torch.zeros(2, 16, dtype=torch.int32)
    counts = {}
    for impl in ("sdpa", FLEX):
        torch.manual_seed(0)
        lm = build_model(model_spec("tiny", tokenizer.info.vocab_size, attn_implementation=impl))
        with torch.no_grad(), DeviceReads(host=[doc_ids]) as reads:
            lm.model(input_ids=ids, **attention_inputs("causal", doc_ids, attn_implementation=impl,
                                                       host_doc_ids=doc_ids.numpy()))
        counts[impl] = reads.sites
    assert counts[FLEX] == {}
    assert list(counts["sdpa"]) and all(site.startswith("transformers" + os.sep + "masking_utils.py")
                                        for site in counts["sdpa"])


class Reported(torch.Tensor):
    """A tensor that reports ``device`` (and, on the host, whether it is pinned) while its values sit on this CPU:
    what ``DeviceReads`` sees of a GPU's tensors, on a machine without one."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, device: str, pinned: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, values.shape, dtype=values.dtype, device=device)
        t.values, t.pinned = values, pinned
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.is_pinned.default:
            return args[0].pinned
        def values(x):
            return x.values if isinstance(x, Reported) else x

        return func(*tree_map(values, args), **tree_map(values, kwargs or {}))


def test_a_copy_to_the_host_is_a_read_unless_it_is_queued_into_pinned_memory():
    """On tensors that report a CUDA device: a copy the host waits for is a read, a blocking one or a non-blocking
    one into pageable memory (CUDA copies those synchronously); the trainer's step-end copy (non-blocking into pinned
    memory, read after an event: ``StepResult``) and ``.to("cpu", non_blocking=True)`` (which pins its output) are
    queued and return, so they are not."""
    on_gpu = Reported(torch.arange(4.0), "cuda")
    copies = {"copy_": lambda: torch.empty(4).copy_(on_gpu),
              "copy_ non-blocking into pageable": lambda: torch.empty(4).copy_(on_gpu, non_blocking=True),
              "copy_ non-blocking into pinned": lambda: Reported(torch.empty(4), "cpu", pinned=True).copy_(
                  on_gpu, non_blocking=True),
              "cpu": on_gpu.cpu, "to": lambda: on_gpu.to("cpu"),
              "to non-blocking": lambda: on_gpu.to("cpu", non_blocking=True)}
    counted = {}
    for name, copy in copies.items():
        with DeviceReads(cpu_is_device=False) as reads:
            copy()
        counted[name] = reads.total
    assert counted == {"copy_": 1, "copy_ non-blocking into pageable": 1, "copy_ non-blocking into pinned": 0,
                       "cpu": 1, "to": 1, "to non-blocking": 0}
