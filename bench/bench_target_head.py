"""Target-only LM head vs full LM head for MLM at 30 % masking with a 128k vocabulary (forward + backward).

Both variants run the same MLM step on the same model and batch; the full-head variant computes logits at every
position and then keeps the targets' (what a plain ``model(...).logits`` loss does). The hidden size is small so
the benchmark runs on a CPU in under a minute; the head then dominates, as it does for the 210m preset with the
Llama-3 vocabulary. Run: ``python bench/bench_target_head.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pipeline.data.loading.batch import Batch
from pipeline.model.attention import attention_inputs
from pipeline.model.presets import PRESETS, ModelPreset
from pipeline.objectives import MLM, Masking, MLMConfig


def synthetic_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> Batch:
    """Full rows of one document each, with a random masking plan (every token maskable)."""
    rank = torch.stack([torch.randperm(seq_len, generator=generator) for _ in range(batch)]).int()
    return Batch(input_ids=torch.randint(0, vocab, (batch, seq_len), generator=generator),
                 doc_ids=torch.zeros(batch, seq_len, dtype=torch.int32), mask_rank=rank,
                 mask_draw=torch.randint(0, 1 << 32, (batch, seq_len), generator=generator),
                 span_ids=torch.full((batch, seq_len), -1, dtype=torch.int32), keys=[""] * batch)


def head_bench_parser(doc: str, seq_len: int, reps: int) -> argparse.ArgumentParser:
    """The options the LM-head benchmarks share: a small Llama with a large vocabulary, so the head dominates."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise low)")
    return parser


def small_model(args: argparse.Namespace):
    """The model of ``head_bench_parser``'s options (the tiny preset's heads), seeded; sets the torch threads."""
    torch.set_num_threads(args.threads)
    tiny = PRESETS["tiny"]
    shape = ModelPreset(num_layers=args.layers, hidden_size=args.hidden, ffn_size=4 * args.hidden,
                        num_heads=tiny.num_heads, num_kv_heads=tiny.num_kv_heads, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(shape.to_config(args.vocab), attn_implementation="sdpa")


def full_head_step(model, objective: MLM, batch: Batch) -> torch.Tensor:
    targets = objective.targets(batch)
    attention = attention_inputs(objective.attention_mode, batch.doc_ids,
                                 attn_implementation=model.config._attn_implementation, dtype=model.dtype)
    logits = model(input_ids=targets.input_ids, **attention).logits.float()
    return F.cross_entropy(logits[targets.predict_at], targets.labels[targets.predict_at], reduction="sum")


def target_head_step(model, objective: MLM, batch: Batch) -> torch.Tensor:
    return objective(model, batch)["mlm"].loss_sum


def main() -> None:
    parser = head_bench_parser(__doc__, seq_len=128, reps=7)
    parser.add_argument("--ratio", type=float, default=0.3)
    args = parser.parse_args()
    model = small_model(args)
    objective = MLM(MLMConfig(ratio=args.ratio), Masking(args.ratio, "80-10-10", mask_id=0,
                                                         random_pool=torch.arange(1, args.vocab)))
    batch = synthetic_batch(args.batch, args.seq_len, args.vocab, torch.Generator().manual_seed(0))

    steps = {"full head": full_head_step, "target-only head": target_head_step}
    losses = {name: step(model, objective, batch).item() for name, step in steps.items()}  # warm-up, same loss
    assert abs(losses["full head"] - losses["target-only head"]) <= 1e-4 * abs(losses["full head"]), losses
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.reps):  # interleaved, so machine noise hits both alike
        for name, step in steps.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, objective, batch).backward()
            times[name].append(time.perf_counter() - start)
    print(f"vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}, batch {args.batch}x{args.seq_len}, "
          f"ratio {args.ratio}, {torch.get_num_threads()} threads, {args.reps} reps (forward + backward)")
    for name, ts in times.items():
        print(f"{name:>17}: median {statistics.median(ts) * 1e3:8.1f} ms  [{', '.join(f'{t * 1e3:.0f}' for t in ts)}]")
    median, best = ({name: fn(ts) for name, ts in times.items()} for fn in (statistics.median, min))
    print(f"speed-up of the target-only head: {median['full head'] / median['target-only head']:.2f}x median, "
          f"{best['full head'] / best['target-only head']:.2f}x best run (goal >= 1.3x)")


if __name__ == "__main__":
    main()
