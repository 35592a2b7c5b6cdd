"""What Matryoshka (``matryoshka: {dims: [...]}``) adds to a contrastive step: one supervised step (forward,
InfoNCE, backward) on one model and one batch, plain and with the loss summed over the first H, H/2, H/4 and H/8
dims of the embedding (H: ``--hidden``). The extra terms are similarity matrices of the batch's embeddings, which
the forward dwarfs; this measures how much. The batch is ``bench_grad_cache``'s (rows of query, positive, hard
negative). Run: ``python bench/bench_matryoshka.py``.
"""

from __future__ import annotations

import torch
from bench_grad_cache import interleaved, mixed_batch, paired_ratio, timed
from bench_target_head import head_bench_parser, small_model

from pipeline.objectives import Supervised, SupervisedConfig
from pipeline.objectives.configs import Matryoshka


def main() -> None:
    parser = head_bench_parser(__doc__, seq_len=64, reps=7)
    parser.set_defaults(vocab=8000, hidden=256, layers=2, batch=32)
    args = parser.parse_args()
    model = small_model(args)
    batch = mixed_batch(args.batch, args.seq_len, 0.25, args.vocab)
    dims = tuple(args.hidden // 2**k for k in range(4))
    variants = {"plain": Supervised(SupervisedConfig()),
                "matryoshka": Supervised(SupervisedConfig(matryoshka=Matryoshka(dims=dims)))}

    def step(objective: Supervised) -> float:
        model.zero_grad(set_to_none=True)
        loss = objective.loss(objective.embed(model, batch), [batch]).loss_sum
        loss.backward()
        return loss.item()

    losses = {name: step(o) for name, o in variants.items()}  # warm-up
    times = interleaved(variants, step, args.reps)
    print(f"hidden {args.hidden}, layers {args.layers}, {args.batch} rows x 3 texts of <= {args.seq_len} tokens, "
          f"Matryoshka dims {list(dims)}, {torch.get_num_threads()} threads, {args.reps} reps")
    for name, ts in times.items():
        print(f"{name:>10}: loss {losses[name]:.4f}, {timed(ts)}")
    print(f"matryoshka / plain (median of paired ratios): {paired_ratio(times, 'matryoshka', 'plain'):.2f}x")


if __name__ == "__main__":
    main()
