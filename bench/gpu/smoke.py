"""The first thing run on a lent GPU (<= 90 s): each CUDA path the training levers take, on its own, with one line
each (``smoke <check>: pass|fail|skip, seconds, max error``), so a crash or a wrong kernel shows before the costly
rows (bench/gpu/run.sh stops there on a failure):

    varlen-causal, varlen-bidirectional  torch's flash varlen attention, forward and backward, against SDPA on the
                                         dense document mask, GQA 18/6 heads at head_dim 96 (the 1b preset's), bf16
    head-gemms                           the chunked LM head's ``mm`` / ``addmm`` with ``out_dtype`` against the
                                         unchunked head (loss and both gradients)
    flex-64, flex-2048                   compiled FlexAttention with the sm90 kernel options on the MAGNET block mask,
                                         short (flex-decoding: no options) and long queries, against SDPA
    fused-adam                           optim.fused=deepspeed: FusedAdam built, or torch's fused AdamW taken
    compiled-layer                       one decoder layer of the 1b shape under ``model.compile`` against eager
    zero1                                the trainer's engine on the tiny preset, two optimizer steps of CLM
    device-reads                         device reads over three micro-steps of that ZeRO-1 engine (DeviceReads):
                                         none outside DeepSpeed's optimizer step
    zero2, zero3                         as zero1

    python bench/gpu/smoke.py [--dry-run]   # --dry-run: the CPU form (CUDA-only checks skip; small shapes)

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SKIP = "skip"


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


def flex_check(length: int) -> Callable[[], float]:
    def check() -> float:
        import torch

        from pipeline.model.attention import (
            compiled_flex,
            dense_allowed,
            flex_block_mask,
            flex_kernel_options,
        )

        device = _cuda()
        heads, kv_heads, dim = 18, 6, 96
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


def fused_adam_check() -> float:
    import torch

    from pipeline.experiment import OptimConfig
    from pipeline.train.module import build_optimizer

    device = _cuda()
    param = torch.nn.Parameter(torch.ones(1024, device=device))
    optimizer = build_optimizer([{"params": [param]}], OptimConfig(), "deepspeed")
    param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    print(f"  fused-adam: {type(optimizer).__module__}.{type(optimizer).__name__}", flush=True)
    reference = torch.nn.Parameter(torch.ones(1024, device=device))
    plain = torch.optim.AdamW([reference], **{k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")})
    reference.grad = torch.full_like(reference, 0.5)
    plain.step()
    return _max_error([param], [reference])


def compiled_layer_check() -> float:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    hidden, heads, kv, ffn, length = (1728, 18, 6, 5120, 2048) if cuda else (64, 4, 2, 128, 32)
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=hidden, intermediate_size=ffn,
                                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    compiled = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    compiled.load_state_dict(eager.state_dict())
    layer = compiled.model.layers[0]
    layer.forward = torch.compile(layer.forward, backend="inductor" if cuda else "aot_eager")
    ids = torch.randint(0, 512, (2, length), device=device)
    results = []
    for model in (compiled, eager):
        out = model.model(input_ids=ids).last_hidden_state
        grads = torch.autograd.grad(out.float().square().mean(), list(model.model.layers[0].parameters()))
        results.append([out, *grads])
    return _max_error(results[0], results[1])


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


def _steps(engine, objectives, tokenizer, steps: int):
    from pipeline.train.step import target_counts, train_step

    device = engine.device
    losses = []
    for _ in range(steps):
        host = _batches(tokenizer, 3)
        counts = target_counts(objectives, {"packed": host})
        result = train_step(engine, objectives, {"packed": [b.to(device, non_blocking=True) for b in host]}, 1, 3,
                            counts=counts)
        losses.append(result.losses["clm"])
    return losses


def engine_check(stage: int) -> Callable[[], float]:
    def check() -> float:
        import math

        engine, objectives, tokenizer = _engine(stage)
        try:
            losses = _steps(engine, objectives, tokenizer, 2)
        finally:
            engine.destroy()
        if not all(math.isfinite(x) for x in losses):
            raise AssertionError(f"losses {losses}")
        return 0.0

    return check


def device_reads_check() -> float:
    """Reads in one optimizer step of three micro-steps; none may come from outside DeepSpeed (its optimizer
    step's own: the grad norm, the overflow check)."""
    from pipeline.train.device_reads import DeviceReads

    engine, objectives, tokenizer = _engine(1)
    try:
        _steps(engine, objectives, tokenizer, 1)  # warm: first-step allocations, lazy inits
        host = _batches(tokenizer, 3)
        from pipeline.train.step import target_counts, train_step

        counts = target_counts(objectives, {"packed": host})
        moved = [b.to(engine.device, non_blocking=True) for b in host]
        tensors = [t for b in host for t in vars(b).values() if hasattr(t, "device")]
        with DeviceReads(host=tensors) as reads:
            train_step(engine, objectives, {"packed": moved}, 1, 3, counts=counts)
    finally:
        engine.destroy()
    print(f"  device-reads: {reads.total} ({', '.join(f'{k} x{v}' for k, v in reads.sites.most_common(8)) or 'none'})",
          flush=True)
    outside = {k: v for k, v in reads.sites.items() if not k.startswith("deepspeed")}
    if outside:
        raise AssertionError(f"reads outside DeepSpeed's step: {outside}")
    return float(reads.total)


CHECKS: list[tuple[str, Callable[[], float], float]] = [  # name, check, tolerance of its max error
    ("varlen-causal", varlen_check(True), 0.1),
    ("varlen-bidirectional", varlen_check(False), 0.1),
    ("head-gemms", head_check, 0.05),
    ("flex-64", flex_check(64), 0.1),
    ("flex-2048", flex_check(2048), 0.1),
    ("fused-adam", fused_adam_check, 1e-5),
    ("compiled-layer", compiled_layer_check, 0.1),
    ("zero1", engine_check(1), 0.0),
    ("device-reads", device_reads_check, float("inf")),
    ("zero2", engine_check(2), 0.0),
    ("zero3", engine_check(3), 0.0),  # last: transformers keeps ZeRO-3's construction config while its model lives
]


def run_checks(names: list[str] | None = None) -> list[tuple[str, str, float, float | None, str]]:
    """(name, pass/fail/skip, seconds, max error, note) of each check, each printed as it ends."""
    from attribute import single_process

    single_process()
    results = []
    for name, check, tolerance in CHECKS:
        if names and name not in names:
            continue
        started = time.perf_counter()
        error, note = None, ""
        try:
            error = check()
            status = "pass" if error <= tolerance else "fail"
            note = "" if status == "pass" else f"max error {error:.3g} > {tolerance:g}"
        except Skip as e:
            status, note = SKIP, str(e)
        except Exception as e:  # a check's crash is its result; the next check still runs
            status, note = "fail", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        seconds = time.perf_counter() - started
        err = "-" if error is None else f"{error:.3g}"
        print(f"smoke {name}: {status}, {seconds:.1f} s, max error {err}" + (f" ({note})" if note else ""), flush=True)
        results.append((name, status, seconds, error, note))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the CPU form: CUDA-only checks skip, small shapes")
    parser.add_argument("--checks", nargs="+", help="only these checks")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    results = run_checks(args.checks)
    failed = [name for name, status, *_ in results if status == "fail"]
    print(f"smoke: {len(results) - len(failed)} of {len(results)} passed or skipped, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f", {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
