"""``launch/train.py ... --check``: the run's checks before spending a cluster, on a machine without GPUs too (a
SLURM login node). The user's exact command and overrides go through every check a rank runs before its process
group (:func:`~pipeline.train.preflight.local_preflight`: the config, the DeepSpeed JSON against it, the run
directory and its lock, the tokenizer, the start model, the shards or what builds them, the resume point), then the
step and token budget and the planner's memory estimate for the GPUs named (``--gpu h100 --nodes 4``) or those
present. Exit 0 with a short report, or 2 with one line. It builds no engine and no shards, takes no lock and
writes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig
from pipeline.inputs import has_shards
from pipeline.planner.estimates import GPUS, Cluster, gpu_key
from pipeline.planner.fit import run_memory
from pipeline.run_dir import RunDir
from pipeline.train.preflight import Prepared, local_preflight
from pipeline.train.shard_checks import build_input_files

GPUS_PER_NODE = 8  # a named GPU's count per node when --gpus-per-node is not given and none is present


@dataclass(frozen=True)
class Target:
    """The machines the check is for: ``gpu`` a key of the planner's GPUS (None: a CPU run, or a GPU the planner
    does not know, ``device`` names it)."""

    gpu: str | None
    nodes: int
    ranks_per_node: int
    device: str | None = None  # the GPU here, when the planner does not know it

    @property
    def cuda(self) -> bool:
        return self.gpu is not None or self.device is not None

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        where = f"{self.gpu or self.device} GPU" if self.cuda else "CPU rank"
        return (f"{self.world} rank{'s' * (self.world > 1)} ({self.nodes} node{'s' * (self.nodes > 1)} x "
                f"{self.ranks_per_node} {where}{'s' * (self.ranks_per_node > 1)})")


def target(gpu: str | None, nodes: int, gpus_per_node: int | None, env=os.environ) -> Target:
    """The named GPU and counts, else the GPUs this machine shows, else the CPU ranks of the launcher (or one)."""
    import torch

    if nodes < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise ConfigError(f"--nodes {nodes} / --gpus-per-node {gpus_per_node}: each must be >= 1")
    if gpu is not None and gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r}: not a GPU the planner knows; choose one of {sorted(GPUS)}")
    present = torch.cuda.device_count()
    if gpu is None and present:
        name = torch.cuda.get_device_name()
        gpu = gpu_key(name, torch.cuda.get_device_properties(0).total_memory / 2**30)
        if gpu is None:
            return Target(None, nodes, gpus_per_node or present, name)
    if gpu is None:
        return Target(None, nodes, gpus_per_node or int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))))
    return Target(gpu, nodes, gpus_per_node or present or GPUS_PER_NODE)


def report(exp: ExperimentConfig, ds: dict, where: Target) -> list[str]:
    """The check's lines, or the ConfigError of the first check that fails."""
    world, cuda = where.world, where.cuda
    prepared = local_preflight(exp, 0, world, cuda, ds)
    lines = [f"check of run {exp.name} in {exp.run_dir} on {where.describe()}:",
             f"  tokenizer {prepared.tokenizer.path}: vocabulary {prepared.tokenizer.info.vocab_size}",
             f"  model {exp.model.init}" + (" (a preset)" if prepared.model.checkpoint is None else " (a checkpoint)"),
             *_shard_lines(exp, prepared), _resume_line(exp, prepared), *_budget_lines(exp, prepared, world)]
    if where.gpu:
        lines.append(_memory_line(exp, ds, prepared, where))
    else:
        lines.append(f"  memory: not estimated for {where.device or 'CPU ranks'}; name the cluster's GPU to "
                     f"(--gpu {'|'.join(sorted(GPUS))})")
    return [*lines, *(f"  {note}" for note in prepared.notes)]


def _shard_lines(exp: ExperimentConfig, prepared: Prepared) -> list[str]:
    lines = [f"  shards {p.directory}: "
             + ("built from other inputs; rank 0 rebuilds them (data.rebuild)" if has_shards(p.directory, exp.data)
                else "none yet; rank 0 builds them")
             + f" from {len(files)} input file(s) when the run starts (--check builds nothing)"
             for p, files in build_input_files(exp, prepared.tokenizer)]
    for kind, index in prepared.indexes.items():
        lines.append(f"  shards {index.directory} ({kind}): {index.num_samples:,} samples, {index.num_tokens:,} "
                     f"tokens, built for this tokenizer")
    return lines


def _resume_line(exp: ExperimentConfig, prepared: Prepared) -> str:
    if not exp.checkpoint.resume:
        return "  resume: off (checkpoint.resume=false): starts at step 0"
    run, point = RunDir(exp.run_dir), prepared.resume
    if point is None:
        return f"  resume: no complete checkpoint in {run.checkpoints}: starts at step 0"
    return (f"  resume: from step {point.step} ({run.checkpoint(point.step)}), global batch, shards, model shape "
            f"and objectives checked against it")


def _budget_lines(exp: ExperimentConfig, prepared: Prepared, world: int) -> list[str]:
    t = exp.train
    end = t.stop_at_step or t.steps
    phases = [(n * t.global_batch(world, pd.micro_batch), pd) for n, pd in zip(exp.phase_lengths(), exp.phases_data)]
    lines = [f"  budget: {t.steps:,} steps" + (f" (this start stops at step {end})" if end != t.steps else "")
             + f", global batch {t.global_batch(world)} (micro_batch {t.micro_batch} x grad_accum {t.grad_accum} x "
             f"{world} ranks): {sum(s for s, _ in phases):,} samples, "
             f"{sum(s * pd.seq_len for s, pd in phases):,} tokens"]
    if prepared.train_samples:
        packed = sum(s for s, pd in phases if pd.reads_data_shards)
        lines.append(f"  data.shards: training reads {packed:,} of its {prepared.train_samples:,} samples "
                     f"({packed / prepared.train_samples:.2f} passes)")
    return lines


def _memory_line(exp: ExperimentConfig, ds: dict, prepared: Prepared, where: Target) -> str:
    memory = run_memory(exp, ds, prepared.model.config, Cluster(where.nodes, where.ranks_per_node, GPUS[where.gpu]))
    if not memory.fits:
        raise ConfigError(f"memory: {memory.describe()} does not fit one {where.gpu}; lower train.micro_batch (raise "
                          f"train.grad_accum to keep the batch), set model.activation_checkpointing=true, shard more "
                          f"(a ZeRO-3 --config, more --nodes) or offload (ds_configs/zero3_offload.json); "
                          f"python launch/plan.py --model ... says which fits")
    return f"  memory: {memory.describe()}: fits"
