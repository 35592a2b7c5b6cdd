"""The cost of building a FlexAttention block mask per micro-batch against a 210m forward on the same batch (CPU).

On packed rows (documents of 64..2048 tokens, document masking, MAGNET spans on ~15 % of the tokens) it times,
interleaved: ``flex_block_mask`` for the causal, bidirectional and MAGNET modes (what ``attention_inputs`` builds
once per micro-batch for FlexAttention), the dense bool mask SDPA gets, and the decoder body's forward under
SDPA with that dense mask (no grad: the cheapest forward, so the ratio is an upper bound). The last line is the
headline (goal <= 2 %). Run: ``python bench/bench_block_mask.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModel

from pipeline.model.attention import dense_allowed, flex_block_mask, skipped_blocks
from pipeline.model.presets import get_preset

MODES = ("causal", "bidirectional", "magnet")


def packed_rows(batch: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc ids, span ids) [B, L]: documents of 64..L tokens, the last cut at the row end; spans of 8..32 tokens."""
    doc_ids = torch.empty(batch, seq_len, dtype=torch.int32)
    span_ids = torch.full((batch, seq_len), -1, dtype=torch.int32)
    for row in range(batch):
        start, doc, span = 0, 0, 0
        while start < seq_len:
            end = min(seq_len, start + int(torch.randint(64, seq_len + 1, (), generator=generator)))
            doc_ids[row, start:end] = doc
            for s in range(start + 16, end - 40, 200):  # ~15 % of the tokens in spans
                span_ids[row, s:s + int(torch.randint(8, 33, (), generator=generator))] = span
                span += 1
            start, doc = end, doc + 1
    return doc_ids, span_ids


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="210m")
    parser.add_argument("--vocab", type=int, default=32000, help="only the input embedding's size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise low)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    body = AutoModel.from_config(get_preset(args.preset).to_config(args.vocab), attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
    doc_ids, span_ids = packed_rows(args.batch, args.seq_len, g)
    dense = dense_allowed("causal", doc_ids, span_ids)

    def forward():
        with torch.no_grad():
            body(input_ids=input_ids, attention_mask=dense)

    jobs = {f"block mask {mode}": (lambda mode=mode: flex_block_mask(mode, doc_ids, span_ids)) for mode in MODES}
    jobs |= {"dense mask causal": lambda: dense_allowed("causal", doc_ids, span_ids), f"{args.preset} forward": forward}
    for job in jobs.values():  # warm-up
        job()
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.reps):
        for name, job in jobs.items():
            times[name].append(timed(job))
    documents = sum(len(row.unique()) for row in doc_ids)
    print(f"{args.preset} body, batch {args.batch}x{args.seq_len} ({documents} documents), {torch.get_num_threads()} "
          f"threads, {args.reps} reps; skipped tiles: " + ", ".join(
              f"{mode} {skipped_blocks(flex_block_mask(mode, doc_ids, span_ids)):.0%}" for mode in MODES))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, median in medians.items():
        print(f"{name:>24}: median {median * 1e3:9.1f} ms  [{', '.join(f'{t * 1e3:.1f}' for t in times[name])}]")
    worst = max(medians[f"block mask {mode}"] for mode in MODES)
    print(f"block mask / {args.preset} forward: {worst / medians[f'{args.preset} forward']:.2%} (slowest mode)")


if __name__ == "__main__":
    main()
