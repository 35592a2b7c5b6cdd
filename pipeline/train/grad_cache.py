"""Gradient caching (GradCache, Gao et al. 2021, luyug/GradCache): a contrastive batch larger than memory allows.

The loss of a contrastive batch couples all of its rows (each query is scored against every key), so gradient
accumulation over micro-batches would train smaller batches with fewer negatives. GradCache keeps the big batch:

1. embed every chunk without a graph, saving the RNG state before each (dropout must draw the same masks again);
2. concatenate the embeddings into one leaf, compute the loss of the whole batch and its gradient G with respect to
   the embeddings (in the cross-rank gather's backward, every rank's key gradients reach their owner);
3. re-embed each chunk with a graph, its RNG state restored, and back-propagate ``sum(e_m * G_m)``.

By the chain rule the parameters then hold the gradient of the whole batch's loss; only one chunk's activations
are alive at a time, at the cost of one more forward per chunk. The RNG state after the call is the one after the
first pass, as a single forward of the whole batch would have left it.

The chunks are the step's micro-batches, or (``grad_cache: {tokens: N}``) the step's rows cut by a token budget
(:func:`token_ranges`), so a chunk of short rows holds more rows than one of long rows. Each chunk pads to its own
longest text, and the gradient is the whole batch's whatever the cut.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Torch's CPU and CUDA generator states (dropout draws from them)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class EmbedPass:
    """An objective's embedding pass as the engine's forward runs it (``TrainModule.forward``), so ZeRO-3 gathers
    the parameters for it as for any forward."""

    def __init__(self, objective):
        self.objective = objective

    def __call__(self, model, batch) -> torch.Tensor:
        return self.objective.embed(model, batch)


class GradCache:
    """GradCache over ``chunks`` chunks: ``embed(m)`` embeds chunk m ([rows_m, d]); ``loss(E)`` is the scalar to
    differentiate of all chunks' embeddings E (concatenated, fp32). :meth:`cache` runs steps 1 and 2 and returns the
    loss, detached; :meth:`surrogate` is step 3's scalar of chunk m, for its caller to back-propagate (the engine's
    ``backward``, a micro-step each); :meth:`done`, after the last, leaves the RNG as the first pass did.
    ``replay_rng=False`` exists for the test that shows the replay matters."""

    def __init__(self, embed: Callable[[int], torch.Tensor], chunks: int,
                 loss: Callable[[torch.Tensor], torch.Tensor], replay_rng: bool = True):
        self.embed, self.chunks, self.loss, self.replay_rng = embed, chunks, loss, replay_rng

    def cache(self) -> torch.Tensor:
        self.states, parts = [], []
        for m in range(self.chunks):
            self.states.append(rng_state())
            with torch.no_grad():
                parts.append(self.embed(m).float())
        cache = torch.cat(parts).requires_grad_()
        value = self.loss(cache)
        (grad,) = torch.autograd.grad(value, cache)
        self.after, self.grads = rng_state(), grad.split([len(p) for p in parts])
        return value.detach()

    def surrogate(self, m: int) -> torch.Tensor:
        if self.replay_rng:
            set_rng_state(self.states[m])
        return (self.embed(m).float() * self.grads[m]).sum()

    def done(self) -> None:
        set_rng_state(self.after)


def token_ranges(tokens: list[int], budget: int) -> list[tuple[int, int]]:
    """(begin, end) row ranges covering ``tokens`` (each row's real token count) in order, each as many rows as fit
    in ``budget`` tokens, a row above it alone: sentence-transformers' ``_minibatch_ranges`` with
    ``mini_batch_num_tokens``."""
    ranges, begin, total = [], 0, 0
    for row, n in enumerate(tokens):
        if row > begin and total + n > budget:
            ranges.append((begin, row))
            begin, total = row, 0
        total += n
    return ranges + [(begin, len(tokens))] if tokens else ranges


def split_ranges(ranges: list[tuple[int, int]], tokens: list[int], count: int) -> list[tuple[int, int]]:
    """``ranges`` split until there are ``count``: each time the one of most tokens (the first such) among those of
    two rows or more, where its tokens are halved. Every rank must run as many chunks as the rank that needs most:
    under ZeRO-3 each chunk's forward and backward gather and reduce the parameters with all ranks."""
    ranges = list(ranges)
    while len(ranges) < count:
        cuttable = [i for i, (b, e) in enumerate(ranges) if e - b > 1]
        if not cuttable:
            raise ValueError(f"GradCache: {len(tokens)} rows cannot make the {count} chunks another rank cut; give "
                             f"every rank as many rows a step")
        i = max(cuttable, key=lambda k: sum(tokens[ranges[k][0]:ranges[k][1]]))
        begin, end = ranges[i]
        half, total, cut = sum(tokens[begin:end]) / 2, 0, end - 1
        for row in range(begin, end - 1):
            total += tokens[row]
            if total >= half:
                cut = row + 1
                break
        ranges[i : i + 1] = [(begin, cut), (cut, end)]
    return ranges
