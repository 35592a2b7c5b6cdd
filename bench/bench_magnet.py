"""MAGNET's LM step against a causal (CLM) step on the same model and batch (forward + backward).

The MAGNET step is the ``magnet`` objective: one forward pass of x^m under the context/span mask (a boolean
[B, 1, L, L] mask shared by the heads, so SDPA cannot use its causal-only kernels) giving the MNTP and MSG losses.
The causal step is ``clm`` (``is_causal``, no mask tensor). Both run the LM head on their targets only, and MAGNET
has fewer (masked context + span tokens, ~30 %, against every token for CLM), so the decoder body alone is timed
as well: the same forward + backward without the head, under the MAGNET mask and causally, isolates what the mask
costs. The batch holds one document per row with the real masking plan and MAGNET spans of data prep (8-32
tokens, 15 % of the tokens). SSCL's forward on short sentence units comes on top in training and is not timed.
Run: ``python bench/bench_magnet.py [--device cuda --dtype bf16 --preset 210m --seq-len 2048]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.data.loading.batch import Batch, collate
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.model.attention import attention_inputs
from pipeline.model.presets import PRESETS, ModelPreset
from pipeline.objectives import CLM, CLMConfig, Magnet, MagnetConfig, Masking

SPECIAL_IDS = np.array([0, 1, 2, 3])  # pad, bos, eos, mask


def span_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> Batch:
    """Full rows of one document each, with data prep's masking plans and MAGNET spans."""
    rng = np.random.default_rng(seed)
    plan = PlanSettings(seed=seed, special_ids=SPECIAL_IDS)
    segments = np.array([[0, seq_len]], dtype=np.int32)
    return collate([make_sample(rng.integers(len(SPECIAL_IDS), vocab, seq_len).astype(np.int32), segments, 0, i, plan)
                    for i in range(batch)])


def time_steps(model, steps: dict, batch: Batch, reps: int, sync=lambda: None) -> dict[str, list[float]]:
    """Seconds of each named step (objective -> summed loss), interleaved so machine noise hits all alike."""
    for step in steps.values():  # warm-up
        step(model, batch).backward()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            model.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            step(model, batch).backward()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def body(mode: str):
    """The decoder body alone under ``mode`` (no LM head): a loss of the hidden states to differentiate."""
    def step(model, batch: Batch) -> torch.Tensor:
        attention = attention_inputs(mode, batch.doc_ids, batch.span_ids,
                                     attn_implementation=model.config._attn_implementation, dtype=model.dtype)
        return model.model(input_ids=batch.input_ids, **attention).last_hidden_state.float().square().mean()
    return step


def magnet_and_causal(mask_id: int, vocab: int) -> dict:
    """The steps compared: name -> fn(model, batch) returning the loss to differentiate."""
    magnet = Magnet(MagnetConfig(ratio=0.2), Masking(0.2, "80-10-10", mask_id=mask_id,
                                                    random_pool=torch.arange(len(SPECIAL_IDS), vocab)))
    return {"causal step (clm)": lambda m, b: CLM(CLMConfig())(m, b)["clm"].loss_sum,
            "magnet step": lambda m, b: sum(o.loss_sum for o in magnet(m, b).values()),
            "causal body": body("causal"), "magnet-mask body": body("magnet")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="", help="a model preset (default: the --hidden/--layers shape)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps a shared machine's noise low)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tiny = PRESETS["tiny"]
    shape = PRESETS[args.preset] if args.preset else ModelPreset(
        num_layers=args.layers, hidden_size=args.hidden, ffn_size=4 * args.hidden, num_heads=tiny.num_heads,
        num_kv_heads=tiny.num_kv_heads, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = shape.to_config(args.vocab)
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq_len)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(args.device)
    batch = span_batch(args.batch, args.seq_len, args.vocab).to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times = time_steps(model, magnet_and_causal(3, args.vocab), batch, args.reps, sync)

    spans = float((batch.span_ids >= 0).float().mean())
    print(f"{args.preset or f'hidden {args.hidden}, layers {args.layers}'}, vocab {args.vocab}, batch "
          f"{args.batch}x{args.seq_len}, {spans:.0%} span tokens, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (forward + backward)")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:>18}: median {medians[name] * 1e3:8.1f} ms  [{', '.join(f'{t * 1e3:.0f}' for t in ts)}]")
    # the median of the ratios within each repetition: steps timed back to back share the machine's load
    step, body_ratio = (statistics.median(m / c for m, c in zip(times[magnet], times[causal]))
                        for magnet, causal in (("magnet step", "causal step (clm)"), ("magnet-mask body", "causal body")))
    print(f"magnet / causal (median of paired ratios): step {step:.2f}x, body (attention mask only) {body_ratio:.2f}x")


if __name__ == "__main__":
    main()
