"""The phases resolved: where each starts and how long it runs, and what each reads (its shards, sequence length,
micro-batch and RoPE settings), its unset fields filled from the run's ``data`` and ``train``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.data.format.index import ShardKind
from pipeline.experiment.sample import SAMPLE_INPUTS, sample_shards
from pipeline.experiment.sections import DataConfig, PhaseSpec


@dataclass(frozen=True)
class PhaseData:
    """The packed samples a phase reads and the RoPE settings it trains with (``ExperimentConfig.phase_data``)."""

    shards: str
    seq_len: int
    micro_batch: int  # samples per rank per micro-step
    build_inputs: tuple[str, ...]  # what preflight builds ``shards`` from when missing (data.build_if_missing)
    # the loader (and its state in checkpoints, so a plain string): data.shards' is named by their kind ("packed"),
    # a phase's own shards' by the first phase that reads them ("phases[1]")
    loader: str
    rope_theta: float | None  # the latest rope_theta of this and the earlier phases (None: the start model's)
    context: int  # the longest seq_len of this and the earlier phases: the model's max_position_embeddings floor

    @property
    def reads_data_shards(self) -> bool:
        """The phase reads data.shards (their loader), not shards of its own."""
        return self.loader == ShardKind.PACKED.value


def phase_starts(phases: list[PhaseSpec], steps: int) -> list[int]:
    """First global step of each phase of a run of ``steps`` (a function of the step, so a resume lands in the right
    phase)."""
    starts, acc = [], 0.0
    for p in phases:
        starts.append(round(acc * steps))
        acc += p.share
    return starts


def phase_lengths(phases: list[PhaseSpec], steps: int) -> list[int]:
    """Optimizer steps of each phase."""
    starts = phase_starts(phases, steps)
    return [end - start for start, end in zip(starts, [*starts[1:], steps])]


def phase_at(starts: Sequence[int], step: int) -> int:
    """The phase of the global ``step`` (from 0), given each phase's first step."""
    return max(i for i, s in enumerate(starts) if s <= step)


def resolve_phases_data(phases: list[PhaseSpec], data: DataConfig, micro_batch: int) -> tuple[PhaseData, ...]:
    """:class:`PhaseData` of every phase (``micro_batch``: train.micro_batch), or a ConfigError naming the phase."""
    return tuple(_resolve(phases, data, micro_batch, i) for i in range(len(phases)))


def _resolve(phases: list[PhaseSpec], d: DataConfig, micro_batch: int, i: int) -> PhaseData:
    p = phases[i]
    seq_len = p.seq_len or d.seq_len
    shards = _phase_shards(p, d, i)
    own = os.path.normpath(shards) != os.path.normpath(d.shards)
    first = next(j for j in range(i + 1)
                 if os.path.normpath(_phase_shards(phases[j], d, j)) == os.path.normpath(shards))
    if not own:
        inputs = tuple(d.build_inputs)
    elif os.path.normpath(shards) == sample_shards(seq_len):
        inputs = SAMPLE_INPUTS
    else:  # data.build_inputs, unless they are the sample's that data.shards' default brought
        inputs = () if os.path.normpath(d.shards) == sample_shards(d.seq_len) else tuple(d.build_inputs)
    return PhaseData(shards, seq_len, p.micro_batch or _tokens_kept(d, micro_batch, i, seq_len), inputs,
                     f"phases[{first}]" if own else ShardKind.PACKED.value,
                     next((q.rope_theta for q in reversed(phases[:i + 1]) if q.rope_theta is not None), None),
                     max(q.seq_len or d.seq_len for q in phases[:i + 1]))


def _phase_shards(p: PhaseSpec, d: DataConfig, i: int) -> str:
    where, seq_len = f"phases[{i}]", p.seq_len or d.seq_len
    if p.shards or seq_len == d.seq_len:
        return p.shards or d.shards
    if os.path.normpath(d.shards) == os.path.normpath(d.shards_at(d.seq_len)):
        return d.shards_at(seq_len)
    raise ConfigError(f"{where}.shards: the phase's seq_len {seq_len} is not data.seq_len {d.seq_len}, so it "
                      f"cannot read data.shards ({d.shards}); set {where}.shards to shards built at seq_len "
                      f"{seq_len} (preflight builds them from data.build_inputs when missing)")


def _tokens_kept(d: DataConfig, micro_batch: int, i: int, seq_len: int) -> int:
    """The micro-batch of phase ``i`` at ``seq_len`` with the run's tokens per micro-batch."""
    tokens, where = micro_batch * d.seq_len, f"phases[{i}]"
    if tokens % seq_len:
        raise ConfigError(f"{where}.micro_batch: 0 keeps the run's {tokens} tokens per micro-batch "
                          f"(train.micro_batch {micro_batch} x data.seq_len {d.seq_len}), "
                          f"which seq_len {seq_len} does not divide; set {where}.micro_batch, e.g. "
                          f"{where}.micro_batch={max(1, tokens // seq_len)}")
    return tokens // seq_len
