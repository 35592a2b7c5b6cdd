"""GradCache chunked by a token budget (``grad_cache: {tokens: N}``) against chunked by rows (``grad_cache: true``):
one supervised step (both GradCache passes, forward + backward) on one model and one batch of mixed lengths.

Row chunks are micro-batches of ``--micro`` rows; token chunks hold at most ``--micro`` full rows' tokens
(``--micro`` x 3 x ``--seq-len``: the worst case a row chunk is sized for), cut as the step cuts them
(``token_ranges``). Each
chunk pads to its own longest text, as ``Supervised.embed`` does. The batch: rows of 3 texts (query, positive, hard
negative), a ``--long-fraction`` of them long (texts of width/2..width tokens), the rest short (8..width/8), in
random order. The losses are checked equal before timing. Run: ``python bench/bench_grad_cache.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from bench_target_head import head_bench_parser, small_model

from pipeline.data.format.sample import UNMASKABLE
from pipeline.data.loading.batch import Batch
from pipeline.objectives import Supervised, SupervisedConfig
from pipeline.train.grad_cache import GradCache, token_ranges

SLOTS = 3
T = TypeVar("T")


def mixed_batch(rows: int, width: int, long_fraction: float, vocab: int, seed: int = 0) -> Batch:
    """Pairs rows [rows, 3 x width] whose texts are long or short by row, each pooled over all its tokens."""
    g = torch.Generator().manual_seed(seed)
    long = torch.rand(rows, generator=g) < long_fraction
    low, high = torch.where(long, width // 2, 8), torch.where(long, width, width // 8)
    lengths = low[:, None] + (torch.rand(rows, SLOTS, generator=g) * (high - low)[:, None]).long()
    real = torch.arange(width)[None, None, :] < lengths[..., None]
    doc_ids = torch.where(real, torch.arange(SLOTS)[None, :, None], -1).view(rows, -1).int()
    starts = torch.arange(SLOTS) * width
    return Batch(input_ids=torch.randint(4, vocab, (rows, SLOTS * width), generator=g) * real.view(rows, -1),
                 doc_ids=doc_ids, mask_rank=torch.full(doc_ids.shape, UNMASKABLE, dtype=torch.int32),
                 mask_draw=torch.zeros(doc_ids.shape, dtype=torch.int64),
                 span_ids=torch.full(doc_ids.shape, -1, dtype=torch.int32), keys=[str(r) for r in range(rows)],
                 pool_spans=torch.stack([starts.expand(rows, SLOTS), starts + lengths], -1),
                 text_hash=torch.randint(0, 1 << 62, (rows, SLOTS), generator=g))


def describe(chunks: list[Batch]) -> str:
    """Rows, real tokens and padded tokens (rows x slots x the longest text: what the forward runs) per chunk."""
    real = [int((c.doc_ids >= 0).sum()) for c in chunks]
    padded = [len(c.keys) * SLOTS * int((c.doc_ids.view(-1, c.doc_ids.shape[1] // SLOTS) >= 0).sum(-1).max())
              for c in chunks]
    return (f"{len(chunks)} chunks of {[len(c.keys) for c in chunks]} rows, real tokens max {max(real)}, "
            f"padded tokens max {max(padded)} (all {sum(padded)})")


def interleaved(variants: dict[str, T], step: Callable[[T], object], reps: int) -> dict[str, list[float]]:
    """Seconds of ``step`` on each variant, ``reps`` rounds of one run each in turn: machine noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, variant in variants.items():
            start = time.perf_counter()
            step(variant)
            times[name].append(time.perf_counter() - start)
    return times


def timed(seconds: list[float]) -> str:
    """The median and every repetition, in ms."""
    return f"median {statistics.median(seconds) * 1e3:7.0f} ms [{', '.join(f'{t * 1e3:.0f}' for t in seconds)}]"


def paired_ratio(times: dict[str, list[float]], over: str, base: str) -> float:
    """The median of the round-by-round ratios ``over`` / ``base`` (robust to load that moves whole rounds)."""
    return statistics.median(o / b for o, b in zip(times[over], times[base]))


def main() -> None:
    parser = head_bench_parser(__doc__, seq_len=128, reps=5)
    parser.set_defaults(vocab=8000, hidden=128, layers=2, batch=48)
    parser.add_argument("--micro", type=int, default=8, help="rows a row chunk (a micro-batch)")
    parser.add_argument("--long-fraction", type=float, default=0.25)
    args = parser.parse_args()
    model = small_model(args)
    batch = mixed_batch(args.batch, args.seq_len, args.long_fraction, args.vocab)
    tokens = (batch.doc_ids >= 0).sum(-1).tolist()
    budget = args.micro * SLOTS * args.seq_len
    variants = {"rows": [batch.rows(b, min(b + args.micro, args.batch)) for b in range(0, args.batch, args.micro)],
                "tokens": [batch.rows(b, e) for b, e in token_ranges(tokens, budget)]}
    objective = Supervised(SupervisedConfig())

    def step(chunks: list[Batch]) -> float:
        model.zero_grad(set_to_none=True)
        cache = GradCache(lambda m: objective.embed(model, chunks[m]), len(chunks),
                          lambda e: objective.loss(e, [batch]).loss_sum)
        loss = cache.cache()
        for m in range(len(chunks)):
            cache.surrogate(m).backward()
        cache.done()
        return loss.item()

    losses = {name: step(chunks) for name, chunks in variants.items()}  # warm-up
    assert abs(losses["rows"] - losses["tokens"]) <= 1e-5 * abs(losses["rows"]), losses
    times = interleaved(variants, step, args.reps)
    print(f"hidden {args.hidden}, layers {args.layers}, {args.batch} rows x {SLOTS} texts of <= {args.seq_len} "
          f"tokens, {args.long_fraction:.0%} long rows, micro {args.micro}, budget {budget} tokens, "
          f"{torch.get_num_threads()} threads, {args.reps} reps")
    for name, ts in times.items():
        print(f"{name:>6}: {timed(ts)}; {describe(variants[name])}")
    print(f"tokens / rows (median of paired ratios): {paired_ratio(times, 'tokens', 'rows'):.2f}x")


if __name__ == "__main__":
    main()
