"""Chunked vs full LM head for CLM with a 128k vocabulary: peak memory and step time (forward + backward), CPU;
and the chunked head against its previous version (``previous_chunked`` below: more fp32 passes per chunk).

Both heads run the same CLM step on the same model, batch and targets (every position of 4 x 2048 tokens predicts
the next one): the full head is ``target_loss`` with the model's ``nn.Linear`` (fp32 logits of every target, then
cross-entropy), the chunked head is ``target_loss`` with a ``ChunkedLMHead`` sharing that weight
(``pipeline/model/lm_head.py``). Repetitions are interleaved. Peak memory is the process's peak resident set
during the step above its resident set just before (``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs``, freed heap pages returned first with ``malloc_trim``), so it counts everything the
step allocates, body included; the step-time ratio is the median over repetitions of chunked / full measured back
to back. Run:
``python bench/bench_lm_head.py``; the last two lines are the headline ratios (goal: memory <= 0.25x, time <= 1.05x
of the full head; time < 1x of the previous chunked head).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time

import torch
from bench_target_head import head_bench_parser, small_model, synthetic_batch

from pipeline.model import lm_head
from pipeline.model.attention import attention_inputs
from pipeline.model.lm_head import DEFAULT_CHUNK, ChunkedLMHead
from pipeline.objectives import CLM, CLMConfig
from pipeline.objectives.base import target_loss

LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def previous_chunked(hidden, weight, labels, chunk_size, grads, per_target=False):
    """The chunk loop before its fp32 passes were cut (the baseline): the bf16 product cast to fp32 logits, a
    log-sum-exp and an amax pass, the softmax made in place and cast, the weight gradient's share made in the matmul
    dtype and cast before it is added."""
    loss = torch.zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.int64)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32) if grads else None
    for start in range(0, len(labels), chunk_size):
        rows = slice(start, start + chunk_size)
        logits = (hidden[rows] @ weight.T).float()
        lse = logits.logsumexp(-1)
        label_logit = logits.gather(-1, labels[rows, None]).squeeze(-1)
        loss += (lse - label_logit).sum()
        correct += (label_logit >= logits.amax(-1)).sum()
        if grads:
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(len(grad_logits)), labels[rows]] -= 1.0
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            if grad_weight.dtype == weight.dtype:
                grad_weight.addmm_(grad_logits.T, hidden[rows])
            else:
                grad_weight += (grad_logits.T @ hidden[rows]).float()
    return loss, correct, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None


class PreviousChunkedHead(ChunkedLMHead):
    """The chunked head running ``previous_chunked``'s loop."""

    def forward(self, hidden, labels=None, per_target=False):
        with swapped(lm_head, "_chunked", previous_chunked):
            return super().forward(hidden, labels, per_target)


@contextlib.contextmanager
def swapped(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def step(model, head, objective: CLM, batch) -> tuple[float, float]:
    """(seconds, peak extra MiB) of one forward + backward with ``head`` as the LM head."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    LIBC.malloc_trim(0)  # give freed heap pages back, so memory the other head freed is not reused unseen
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set to the current one
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    targets = objective.targets(batch)
    attention = attention_inputs(objective.attention_mode, batch.doc_ids, dtype=model.dtype)
    hidden = model.model(input_ids=targets.input_ids, **attention).last_hidden_state
    target_loss(head, hidden, targets).loss_sum.backward()
    return time.perf_counter() - start, (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = head_bench_parser(__doc__, seq_len=2048, reps=3)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="rows per chunk of the chunked head")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype (bfloat16: the matmul dtype of a GPU run; slow on most CPUs)")
    args = parser.parse_args()
    model = small_model(args).to(getattr(torch, args.dtype))
    heads = {"full": model.lm_head}
    for name, kind in (("previous", PreviousChunkedHead), ("chunked", ChunkedLMHead)):
        heads[name] = kind(args.hidden, args.vocab, bias=False, device="meta")
        heads[name].weight, heads[name].chunk_size = model.lm_head.weight, args.chunk  # the same parameter
    objective = CLM(CLMConfig())
    batch = synthetic_batch(args.batch, args.seq_len, args.vocab, torch.Generator().manual_seed(0))

    with torch.no_grad():  # same loss from both heads before timing
        targets = objective.targets(batch)
        hidden = model.model(input_ids=targets.input_ids, is_causal=True).last_hidden_state
        losses = {name: target_loss(head, hidden, targets).loss_sum.item() for name, head in heads.items()}
    tolerance = 1e-5 if args.dtype == "float32" else 1e-2  # bf16 logits differ in rounding between the heads
    assert all(abs(losses["full"] - v) <= tolerance * abs(losses["full"]) for v in losses.values()), losses
    times: dict[str, list[float]] = {name: [] for name in heads}
    peaks: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(args.reps):  # interleaved, so machine noise hits both alike
        for name, head in heads.items():
            seconds, mib = step(model, head, objective, batch)
            times[name].append(seconds)
            peaks[name].append(mib)
    print(f"vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}, CLM {args.batch}x{args.seq_len} "
          f"({int(targets.predict_at.sum())} targets), chunk {args.chunk}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (forward + backward)")
    for name in heads:
        print(f"{name:>8}: median {statistics.median(times[name]) * 1e3:8.0f} ms "
              f"[{', '.join(f'{t * 1e3:.0f}' for t in times[name])}], peak {max(peaks[name]):8.0f} MiB "
              f"[{', '.join(f'{m:.0f}' for m in peaks[name])}]")
    memory = max(peaks["chunked"]) / max(peaks["full"])
    paired = [c / f for f, c in zip(times["full"], times["chunked"])]  # measured back to back: robust to load drift
    print(f"step time ratio per repetition: {', '.join(f'{r:.2f}' for r in paired)}; ratio of medians "
          f"{statistics.median(times['chunked']) / statistics.median(times['full']):.2f}x, of best runs "
          f"{min(times['chunked']) / min(times['full']):.2f}x")
    print(f"chunked/full LM head: peak memory {memory:.2f}x, step time {statistics.median(paired):.2f}x")
    against = [c / p for p, c in zip(times["previous"], times["chunked"])]
    print(f"chunked/previous chunked LM head: peak memory {max(peaks['chunked']) / max(peaks['previous']):.2f}x, "
          f"step time {statistics.median(against):.2f}x (pairs {', '.join(f'{r:.2f}' for r in against)})")


if __name__ == "__main__":
    main()
