"""The run's progress, the part of a checkpoint that is ours (DeepSpeed's ``client_state``).

:class:`TrainState` is what the trainer advances each step and what the
:class:`~pipeline.train.checkpoint.Checkpointer` saves and restores through ``state_dict()`` /
``load_state_dict()`` (torchtitan's ``Stateful``). Two things a resume needs live elsewhere in the checkpoint: each
rank's RNG state in ``rng-rank<r>.pt`` (DeepSpeed writes the client state on rank 0 alone below ZeRO-3, and every
rank has its own generators), and the world size in the ``COMPLETE`` marker (read before loading: it decides how to
load). The phase is not saved: it is a function of the step and the experiment (``pipeline.experiment.phase_at``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.data.loading.loader import ShardLoader


@dataclass
class TrainState:
    """Optimizer steps done, tokens trained on (in all and per corpus source), and the loaders' positions."""

    loaders: dict[str, ShardLoader]  # by name: the packed shards, the units, the pairs, a phase's own shards
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    # tokens seen of each corpus source of the packed shards, when they have several (the run logs losses per source)
    source_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def sources(self) -> tuple[str, ...]:
        """The corpus sources counted apart; () when the packed shards have one."""
        return tuple(self.source_tokens)

    def advance(self, tokens: int) -> None:
        """One optimizer step done over ``tokens`` tokens (all ranks')."""
        self.step += 1
        self.tokens_seen += tokens

    def state_dict(self) -> dict:
        """The client state saved with the engine's."""
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "loaders": {name: loader.state_dict() for name, loader in self.loaders.items()},
                **({"source_tokens": dict(self.source_tokens)} if self.source_tokens else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved client state. The sources counted stay this run's (one the checkpoint lacks starts at 0);
        a checkpoint written before this class also carries ``phase``, which is derived and ignored."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        for name, loader_state in state["loaders"].items():
            self.loaders[name].load_state_dict(loader_state)
        saved = state.get("source_tokens", {})
        self.source_tokens = {src: saved.get(src, 0) for src in self.source_tokens}
