"""The smoke test of a lent GPU: each CUDA path the training levers take, on its own, one line each
(``smoke <check>: pass|off|crash|skip, seconds (priced), max error``). Only a crash (an exception, a kernel error,
a non-finite result) stops bench/gpu/run.sh; numerics outside their tolerance ("off") and timings are reported and
the run goes on. The checks run in two groups, each priced (cold, on one H100) for the plan of the call
(bench/gpu/ablate.py prints it):

    first (before the rows; run.sh runs them: paths the first rows take)
    varlen-causal, varlen-bidirectional  torch's flash varlen attention, forward and backward, against SDPA on the
                                         dense document mask, GQA 18/6 heads at head_dim 96 (the 1b preset's), bf16
    head-gemms                           the chunked LM head's ``mm`` / ``addmm`` with ``out_dtype`` against the
                                         unchunked head (loss and both gradients)
    zero1                                the trainer's engine on the tiny preset, two optimizer steps of CLM, then
                                         the device reads of a third (DeviceReads): its max error is the count of
                                         reads outside DeepSpeed's optimizer step (tolerance 0)
    zero3                                as zero1, without the reads
    last (after the rows; ablate.py runs them with the time it keeps for them)
    flex-64, flex-2048                   compiled FlexAttention with the sm90 kernel options on the MAGNET block mask
                                         against SDPA: short queries at GQA 32/8 and head_dim 128 (the 8b preset's;
                                         torch takes its flex-decoding path, without options, only where the GQA
                                         ratio is a power of two), long ones at the 1b preset's 18/6

Not here: DeepSpeed's FusedAdam (an nvcc build of minutes; the ablation's last row, ``optim.fused=deepspeed``) and a
compiled layer against eager (the ablation's best row compiles the 1b layer; its "best, eager" row logs the same
steps' loss beside it).

    python bench/gpu/smoke.py [--dry-run] [--last] [--checks NAME ...]   # --dry-run: the CPU form (CUDA-only
                                                                          # checks skip; small shapes)

Exit status 1 when a check crashed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SKIP, CRASH = "skip", "crash"
START_S = 20.0  # the interpreter, torch's and DeepSpeed's imports, the CUDA context: each group's process pays it


class Skip(Exception):
    """A check that cannot run here (a CUDA kernel on the CPU)."""


def _cuda():
    import torch

    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    return torch.device("cuda")


def _max_error(got, want) -> float:
    return max(float((g.detach().float() - w.detach().float()).abs().max()) for g, w in zip(got, want, strict=True))


def _packed_doc_ids(batch: int, length: int, device):
    """int32 [batch, length]: documents of 37..300 tokens, then padding in the last row."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for r in range(batch):
        ids, doc, pos = [], 0, 0
        while pos < length:
            n = int(torch.randint(37, 300, (1,), generator=g))
            ids += [doc] * min(n, length - pos)
            pos, doc = pos + n, doc + 1
        if r == batch - 1:
            ids[length - length // 5:] = [-1] * (length // 5)
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def varlen_check(causal: bool) -> Callable[[], float]:
    def check() -> float:
        import torch

        from pipeline.model.attention import dense_allowed
        from pipeline.model.varlen import packed_segments, varlen_attention

        device = _cuda()
        batch, length, heads, kv_heads, dim = 2, 2048, 18, 6, 96
        doc_ids = _packed_doc_ids(batch, length, device)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(batch, h, length, dim, device=device, dtype=torch.bfloat16, generator=g,
                               requires_grad=True) for h in (heads, kv_heads, kv_heads))
        seg = packed_segments(doc_ids, True, doc_ids.cpu().numpy())
        out = varlen_attention(q, k, v, seg.cu_seqlens, seg.max_seqlen, causal=causal, scale=None)
        mask = dense_allowed("causal" if causal else "bidirectional", doc_ids)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
        real = (doc_ids >= 0)[..., None, None]
        got = torch.autograd.grad((out.float() * real).square().sum(), (q, k, v))
        want = torch.autograd.grad((ref.float() * real).square().sum(), (q, k, v))
        return _max_error([out * real] + list(got), [ref * real] + list(want))

    return check


def head_check() -> float:
    import torch

    from pipeline.model.lm_head import cross_entropy, linear_cross_entropy

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    rows, hidden_size, vocab = (4096, 1728, 32768) if cuda else (300, 32, 500)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device=device, dtype=dtype, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=rows // 4)
    got = [loss / rows, *torch.autograd.grad(loss / rows, (hidden, weight))]
    ref_loss, _ = cross_entropy((hidden @ weight.T).float(), labels)
    want = [ref_loss / rows, *torch.autograd.grad(ref_loss / rows, (hidden, weight))]
    return _max_error(got, want)


def flex_check(length: int, heads: int, kv_heads: int, dim: int) -> Callable[[], float]:
    def check() -> float:
        import torch

        from pipeline.model.attention import (
            compiled_flex,
            dense_allowed,
            flex_block_mask,
            flex_kernel_options,
        )

        device = _cuda()
        doc_ids = _packed_doc_ids(2, length, device) if length > 300 else torch.zeros(2, length, dtype=torch.int32,
                                                                                     device=device)
        span_ids = torch.full_like(doc_ids, -1)
        span_ids[:, length // 2: length // 2 + 8] = 0
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(2, h, length, dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        block = flex_block_mask("magnet", doc_ids, span_ids)
        out = compiled_flex()(q, k, v, block_mask=block, enable_gqa=True, kernel_options=flex_kernel_options(q))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_allowed("magnet", doc_ids, span_ids), enable_gqa=True)
        got = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        want = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        return _max_error([out, *got], [ref, *want])

    return check


def _engine(stage: int):
    """The trainer's engine (``build_engine``) on the tiny preset with ``ds_configs/zero<stage>.json``, CLM."""
    import torch

    from pipeline.config import from_dict
    from pipeline.experiment import SAMPLE_DIR, PhaseSpec, load_experiment
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.engine_spec import engine_spec
    from pipeline.train.module import build_engine
    from pipeline.train.phases import build_objectives
    from pipeline.train.preflight import check_model

    cuda = torch.cuda.is_available()
    exp = load_experiment(None, ["model.init=tiny", "train.micro_batch=2", "train.grad_accum=3", "model.compile=false",
                                 f"model.dtype={'bf16' if cuda else 'fp32'}"])
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    objectives = build_objectives(from_dict(PhaseSpec, {"objectives": [{"name": "clm"}]}), tokenizer)
    ds = resolve_ds_config(load_ds_config(os.path.join(REPO, "ds_configs", f"zero{stage}.json")), exp, 1, cuda)
    lm, engine = build_engine(ds, check_model(exp, tokenizer, ds, cuda), engine_spec(exp, cuda),
                              [o.objective for o in objectives])
    return engine, objectives, tokenizer


def _batches(tokenizer, count: int):
    import torch

    from pipeline.data.format.sample import UNMASKABLE
    from pipeline.data.loading.batch import Batch

    doc_ids = _packed_doc_ids(2, 512, "cpu") // 4
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        ids = torch.randint(10, tokenizer.info.vocab_size, doc_ids.shape, generator=g).masked_fill(doc_ids < 0,
                                                                                                    tokenizer.pad_id)
        out.append(Batch(input_ids=ids, doc_ids=doc_ids, mask_rank=torch.full_like(doc_ids, UNMASKABLE),
                         mask_draw=torch.zeros_like(ids), span_ids=torch.full_like(doc_ids, -1),
                         keys=[f"smoke-{i}-{r}" for r in range(len(ids))]))
    return out


def engine_check(stage: int, reads: bool = False) -> Callable[[], float]:
    """Two optimizer steps of the ZeRO-``stage`` engine, whose losses must be finite; with ``reads``, then the
    device reads of a third (DeviceReads, listed by site), of which those outside DeepSpeed's optimizer step (its
    grad norm and overflow check) are the result."""
    def check() -> float:
        from attribute import host_step

        from pipeline.train.device_reads import DeviceReads
        from pipeline.train.step import target_counts

        engine, objectives, tokenizer = _engine(stage)
        try:
            losses = [host_step(engine, objectives, _batches(tokenizer, 3), 3, engine.device).losses["clm"]
                      for _ in range(2)]  # the first also warms: allocations, lazy inits
            if not all(math.isfinite(x) for x in losses):
                raise FloatingPointError(f"losses {losses}")
            if not reads:
                return 0.0
            host = _batches(tokenizer, 3)
            counts = target_counts(objectives, {"packed": host})  # the loader's side, as in the trainer
            with DeviceReads(host=[t for b in host for t in vars(b).values() if hasattr(t, "device")]) as counted:
                host_step(engine, objectives, host, 3, engine.device, counts)
        finally:
            engine.destroy()
        print(f"  device reads: {counted.total} ("
              + (", ".join(f"{k} x{v}" for k, v in counted.sites.most_common(8)) or "none") + ")", flush=True)
        return float(sum(v for k, v in counted.sites.items() if not k.startswith("deepspeed")))

    return check


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], float]  # returns its max error
    tolerance: float  # of the max error: above it the check is "off", reported, and the run goes on
    price_s: float  # expected seconds, cold, on one H100 (the plan's)
    last: bool = False  # run after the ablation's rows (``--last``) instead of before them


CHECKS = [
    Check("varlen-causal", varlen_check(True), 0.1, 10),
    Check("varlen-bidirectional", varlen_check(False), 0.1, 5),
    Check("head-gemms", head_check, 0.05, 5),
    Check("zero1", engine_check(1, reads=True), 0.0, 30),
    Check("zero3", engine_check(3), 0.0, 20),  # after zero1: transformers keeps ZeRO-3's construction config
    Check("flex-64", flex_check(64, 32, 8, 128), 0.1, 45, last=True),  # two FlexAttention compiles, their block
    Check("flex-2048", flex_check(2048, 18, 6, 96), 0.1, 45, last=True),  # masks' compiled builds
]


def price_s(last: bool) -> float:
    """The plan's seconds for the group: its process's start and its checks."""
    return START_S + sum(c.price_s for c in CHECKS if c.last == last)


def run_checks(checks: list[Check]) -> list[tuple[str, str, float, float | None, str]]:
    """(name, pass/off/crash/skip, seconds, max error, note) of each check, each printed as it ends. A crash is an
    exception, a kernel error (synchronised inside the check's time, so it is that check's) or a non-finite max
    error; the next check still runs."""
    import torch

    results = []
    for c in checks:
        started = time.perf_counter()
        error, note = None, ""
        try:
            error = c.run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if not math.isfinite(error):
                status, note = CRASH, "non-finite result"
            else:
                status = "pass" if error <= c.tolerance else "off"
                note = "" if status == "pass" else f"max error {error:.3g} > {c.tolerance:g}: reported, the run goes on"
        except Skip as e:
            status, note = SKIP, str(e)
        except Exception as e:  # a check's crash is its result; the next check still runs
            status, note = CRASH, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        seconds = time.perf_counter() - started
        err = "-" if error is None else f"{error:.3g}"
        print(f"smoke {c.name}: {status}, {seconds:.1f} s (priced {c.price_s:g}), max error {err}"
              + (f" ({note})" if note else ""), flush=True)
        results.append((c.name, status, seconds, error, note))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the CPU form: CUDA-only checks skip, small shapes")
    parser.add_argument("--last", action="store_true", help="the checks that run after the ablation's rows")
    parser.add_argument("--checks", nargs="+", help="only these checks (of either group)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from attribute import single_process

    started = time.perf_counter()
    single_process()
    results = run_checks([c for c in CHECKS if (c.name in args.checks if args.checks else c.last == args.last)])
    by = {status: [name for name, s, *_ in results if s == status] for status in ("pass", "off", SKIP, CRASH)}
    print(f"smoke: {len(by['pass'])} passed, {len(by['off'])} off, {len(by[SKIP])} skipped, {len(by[CRASH])} crashed"
          + "".join(f" ({status}: {', '.join(names)})" for status, names in by.items() if names and status != "pass")
          + f"; {time.perf_counter() - started:.0f} s, priced {price_s(args.last):.0f}", flush=True)
    return 1 if by[CRASH] else 0


if __name__ == "__main__":
    sys.exit(main())
