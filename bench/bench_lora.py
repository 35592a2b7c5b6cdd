"""LoRA against full-parameter training: step time and the memory of what training keeps per parameter.

One process, one model shape, two copies from the same weights: (a) full-parameter AdamW, (b) LLM2Vec's LoRA
(``pipeline.model.lora.add_lora``: r 16, alpha 32, dropout 0.05 on q/k/v/o/gate/up/down) with AdamW on the
adapter. Steps alternate between them on the same batch (forward, backward, optimizer step), so machine noise hits
both alike. Prints the median step times, their ratio, and the bytes of gradients plus Adam moments (what LoRA
saves; the weights themselves are the same). Run from the repository root:

    python bench/bench_lora.py [--preset 20m] [--seq-len 128] [--batch 8] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.model.build import build_model, model_spec
from pipeline.model.lora import LLM2VEC_TARGETS, add_lora

VOCAB = 8000  # the sample tokenizer's


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Gradients and Adam moments held after a step."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    moments = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    return grads + moments


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="20m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    models = {}
    for kind in ("full", "lora"):
        torch.manual_seed(0)
        model = build_model(model_spec(args.preset, VOCAB))
        if kind == "lora":
            add_lora(model, 16, 32.0, 0.05, LLM2VEC_TARGETS)
        model.train()
        models[kind] = (model, torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4))
    ids = torch.randint(4, VOCAB, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for step in range(args.steps + 1):  # the first step of each allocates the optimizer states: not timed
        for kind, (model, optimizer) in models.items():
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if step:
                times[kind].append(time.perf_counter() - start)
    med = {kind: statistics.median(t) for kind, t in times.items()}
    mem = {kind: state_bytes(*models[kind]) for kind in models}
    trainable = {kind: sum(q.numel() for q in m.parameters() if q.requires_grad) for kind, (m, _) in models.items()}
    print(f"{args.preset}, {args.batch} x {args.seq_len} tokens a step, {torch.get_num_threads()} threads, "
          f"{args.steps} steps each (alternating)")
    for kind in models:
        print(f"  {kind:5} {trainable[kind] / 1e6:7.2f} M trainable  step {med[kind] * 1e3:8.1f} ms  gradients + "
              f"Adam moments {mem[kind] / 2**20:8.1f} MiB")
    print(f"  lora / full: step time {med['lora'] / med['full']:.2f}x, gradient and optimizer memory "
          f"{mem['lora'] / mem['full']:.3f}x")


if __name__ == "__main__":
    main()
