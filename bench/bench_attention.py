"""Attention on packed documents, one process: varlen vs dense-mask SDPA vs FlexAttention (forward + backward).

On packed rows (documents of 64..L tokens, document masking, MAGNET spans on ~15 % of the tokens; the rows of
``bench_block_mask.py``) with a preset's head shape, it times per mode, interleaved: each implementation's
per-micro-batch input (the dense bool mask, the compiled block-mask build, the varlen segments with their one host
sync) and the attention of one layer forward + backward on it (GQA without repeated K/V everywhere). The ratio is
SDPA's time over the row's (> 1: faster than dense-mask SDPA). The bench row names are those of
``model.attn_implementation``: ``sdpa`` / ``flex`` / ``varlen``.

On CUDA (bf16) every row runs. On CPU varlen has no kernel and FlexAttention no backward, so it says so and times
forwards only (fp32), with the block mask built eagerly. Run: ``python bench/bench_attention.py`` (on a GPU:
``--batch 4 --seq-len 2048 --preset 1b``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_block_mask import packed_rows

from pipeline.model.attention import compiled_flex, dense_allowed, flex_block_mask, flex_kernel_options
from pipeline.model.presets import get_preset
from pipeline.model.varlen import available as varlen_available
from pipeline.model.varlen import packed_segments, varlen_attention

MODES = ("causal", "bidirectional", "magnet")


def timed(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="210m", help="whose heads, KV heads and head_dim")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = get_preset(args.preset)
    head_dim = shape.hidden_size // shape.num_heads
    g = torch.Generator().manual_seed(0)
    doc_ids, span_ids = (t.to(device) for t in packed_rows(args.batch, args.seq_len, g))
    q, k, v = (torch.randn(args.batch, heads, args.seq_len, head_dim, device=device, dtype=dtype,
                           requires_grad=cuda) for heads in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads))
    grad = torch.randn_like(q.transpose(1, 2))  # every output in HF's [B, L, heads, head_dim]
    print(f"{args.preset} heads {shape.num_heads}/{shape.num_kv_heads} x {head_dim}, batch {args.batch}x{args.seq_len}, "
          f"{sum(len(row.unique()) for row in doc_ids)} documents, {device} {dtype}, {args.reps} reps"
          + ("" if cuda else "; CPU: forward only (no FlexAttention backward), varlen not measured (CUDA kernels "
                             "only)"))

    def run(attention):
        out = attention()
        if cuda:
            out.backward(grad)

    jobs = {}
    for mode in MODES:
        dense = dense_allowed(mode, doc_ids, span_ids)
        block = flex_block_mask(mode, doc_ids, span_ids)
        jobs[mode, "sdpa", "input"] = lambda mode=mode: dense_allowed(mode, doc_ids, span_ids)
        jobs[mode, "sdpa", "attention"] = lambda dense=dense: run(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True).transpose(1, 2))
        jobs[mode, "flex", "input"] = lambda mode=mode: flex_block_mask(mode, doc_ids, span_ids)
        jobs[mode, "flex", "attention"] = lambda block=block: run(lambda: compiled_flex()(
            q, k, v, block_mask=block, enable_gqa=True, kernel_options=flex_kernel_options(q)).transpose(1, 2))
        segments = packed_segments(doc_ids, document_masking=True)
        if cuda and varlen_available() and mode != "magnet" and segments is not None:
            jobs[mode, "varlen", "input"] = lambda: packed_segments(doc_ids, document_masking=True)
            jobs[mode, "varlen", "attention"] = lambda mode=mode, s=segments: run(lambda: varlen_attention(
                q, k, v, s.cu_seqlens, s.max_seqlen, causal=mode == "causal", scale=None))
    for job in jobs.values():  # warm-up: compiles
        job()
    times = {name: [] for name in jobs}
    for _ in range(args.reps):
        for name, job in jobs.items():
            times[name].append(timed(job, cuda))
    median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"{'mode':>13} {'row':>6} {'input ms':>9} {'attention ms':>13} {'sdpa / row':>11}")
    for mode in MODES:
        for impl in ("sdpa", "flex", "varlen"):
            if (mode, impl, "attention") not in median:
                print(f"{mode:>13} {impl:>6}  not measured ({'varlen cannot express MAGNET' if mode == 'magnet' else 'CUDA only'})")
                continue
            ratio = median[mode, "sdpa", "attention"] / median[mode, impl, "attention"]
            print(f"{mode:>13} {impl:>6} {median[mode, impl, 'input']:9.2f} {median[mode, impl, 'attention']:13.2f} "
                  f"{ratio:10.2f}x")


if __name__ == "__main__":
    main()
