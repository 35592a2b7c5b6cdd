"""The training loop: model, objectives, data and DeepSpeed meet here and nowhere else."""

from __future__ import annotations

import os
import time

import deepspeed
import torch
import torch.distributed as dist
import yaml

from pipeline.config import to_dict
from pipeline.data.loader import ShardLoader, check_compatible, check_source
from pipeline.data.manifest import DatasetIndex, load_index, write_json_atomic
from pipeline.export.record import from_experiment
from pipeline.model.flops import flops_per_token
from pipeline.train import checkpoint
from pipeline.train.ds_config import resolve_ds_config
from pipeline.train.experiment import ExperimentConfig
from pipeline.train.guard import DivergenceGuard
from pipeline.train.metrics import MetricsLogger, device_peak_tflops, memory_gib
from pipeline.train.model import build_train_model, export_hf
from pipeline.train.phases import WeightedObjective, data_sources
from pipeline.train.preflight import Prepared
from pipeline.train.schedule import lr_multiplier
from pipeline.train.shards import ensure_shards
from pipeline.train.signals import StopRequest

# The loop's own collectives (target counts, logged sums, the stop flag) use small tensors on the training device,
# since NCCL refuses CPU tensors.
DIST_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _write_run_files(exp: ExperimentConfig, ds: dict, lm, index: DatasetIndex) -> dict[str, dict]:
    files = {"experiment.json": to_dict(exp), "ds_config.json": ds, "model_config.json": lm.config.to_dict(),
             "data.json": {"directory": index.directory, "fingerprint": index.fingerprint,
                           "samples": index.num_samples, "tokens": index.num_tokens}}
    os.makedirs(exp.run_dir, exist_ok=True)
    for name, obj in files.items():
        write_json_atomic(os.path.join(exp.run_dir, name), obj)
    with open(os.path.join(exp.run_dir, "experiment.yaml"), "w") as f:
        yaml.safe_dump(to_dict(exp), f, sort_keys=False)
    return files


def train_step(engine, step_objs: list[WeightedObjective], batches: dict[str, list], world: int,
               grad_accum: int) -> tuple[dict[str, float], dict[str, float], float]:
    """One optimizer step over ``grad_accum`` micro-steps; returns (loss per output, accuracy per output, lr).

    Every loss is normalised by its target count over the whole global batch (all ranks, all micro-steps), so
    the step equals one big-batch step whatever the split; DeepSpeed averages gradients over ranks and
    micro-steps, hence the ``world * grad_accum`` factor.
    """
    counts: dict[str, float] = {}
    weights: dict[str, float] = {}
    for o in step_objs:
        for b in batches[o.objective.source]:
            for name, n in o.objective.num_targets(b).items():
                counts[name] = counts.get(name, 0.0) + float(n)
                weights[name] = o.weight * o.objective.loss_weights[name]
    names = list(counts)
    device = next(engine.module.parameters()).device
    total = torch.tensor([counts[n] for n in names], device=device)
    dist.all_reduce(total)
    total = dict(zip(names, total.clamp(min=1).tolist()))
    sums = torch.zeros(len(names), 2, device=device)
    lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside the last step()
    for micro in range(grad_accum):
        loss = 0.0
        for o in step_objs:
            for name, (loss_sum, _, correct) in engine(o.objective, batches[o.objective.source][micro]).items():
                loss = loss + weights[name] * loss_sum * (world * grad_accum / total[name])
                sums[names.index(name)] += torch.stack([loss_sum.detach().float(), correct.float()])
        engine.backward(loss)
        engine.step()
    dist.all_reduce(sums)
    return ({n: sums[i, 0].item() / total[n] for i, n in enumerate(names)},
            {n: sums[i, 1].item() / total[n] for i, n in enumerate(names)}, lr)


def _open_loaders(exp: ExperimentConfig, objectives, index: DatasetIndex, rank: int, world: int,
                  pin: bool) -> dict[str, ShardLoader]:
    """A loader per data source any phase reads: the packed shards, and the sentence units when asked for."""
    t, d = exp.train, exp.data
    readers = data_sources(objectives)
    if readers["packed"]:
        check_source(index, "packed", "data.shards", readers["packed"])
    loaders = {"packed": ShardLoader(index, t.micro_batch, t.grad_accum, rank, world, t.seed, d.num_workers,
                                     pin_memory=pin, verify=d.verify_shards)}
    if readers["units"]:  # preflight checked them against the tokenizer and the objectives
        loaders["units"] = ShardLoader(load_index(d.unit_shards), d.unit_micro_batch or t.micro_batch, t.grad_accum,
                                       rank, world, t.seed, d.num_workers, pin_memory=pin, verify=d.verify_shards)
    return loaders


def start_distributed() -> tuple[torch.device, int, int]:
    """(device, rank, world size) once torch.distributed runs: the rendezvous only, no engine yet."""
    device = _device()
    deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])
    return device, dist.get_rank(), dist.get_world_size()


def train(exp: ExperimentConfig, ds_raw: dict, prepared: Prepared, stop: StopRequest, device: torch.device) -> dict:
    """Train after :func:`pipeline.train.preflight.preflight`; ``stop`` ends start-up at once, training at a
    checkpoint."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(exp.train.seed)

    tokenizer, objectives = prepared.tokenizer, prepared.objectives
    index = ensure_shards(exp.data, tokenizer, rank)
    check_compatible(index, tokenizer.info.fingerprint, exp.data.seq_len)

    bf16 = exp.model.dtype == "bf16" or (exp.model.dtype == "auto" and device.type == "cuda")
    ds = resolve_ds_config(ds_raw, exp, world, bf16)
    lm, model, optimizer = build_train_model(exp, ds, tokenizer, bf16, [o.objective for p in objectives for o in p])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, exp.train.steps, exp.optim)) if optimizer is not None else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=None if optimizer
                                           else [p for p in model.parameters() if p.requires_grad],
                                           lr_scheduler=scheduler, config=ds)
    if scheduler is None:  # DeepSpeed built the optimizer (ds config "optimizer" section)
        engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: lr_multiplier(s, exp.train.steps, exp.optim))
    run_files = _write_run_files(exp, ds, lm, index) if rank == 0 else {}
    loaders = _open_loaders(exp, objectives, index, rank, world, device.type == "cuda")

    step, tokens_seen = 0, 0
    resume_step = checkpoint.latest_complete(exp.run_dir) if exp.checkpoint.resume else None
    if resume_step is not None:
        client = checkpoint.load(engine, exp.run_dir, resume_step)
        step, tokens_seen = client["step"], client["tokens_seen"]
        for src, state in client["loaders"].items():
            loaders[src].load_state_dict(state)
        if rank == 0:
            print(f"resumed from {checkpoint.tag_for(step)} ({tokens_seen:,} tokens seen)")

    metrics = MetricsLogger(exp.run_dir, rank == 0, exp.train.log_every, start_step=step)
    guard = DivergenceGuard(exp.train.max_bad_steps, skipped_before=engine.skipped_steps)
    flops_tok = flops_per_token(lm.config, exp.data.seq_len)
    peak = device_peak_tflops(exp.train.peak_tflops)
    last_saved = step

    def save() -> None:
        nonlocal last_saved
        client = {"step": step, "tokens_seen": tokens_seen,
                  "loaders": {src: loader.state_dict() for src, loader in loaders.items()},
                  "phase": exp.phase_at(max(step - 1, 0))[1].name}
        checkpoint.save(engine, exp.run_dir, step, client, run_files, exp.checkpoint.keep_last,
                        exp.checkpoint.keep_every)
        last_saved = step

    def last_good() -> str | None:
        good = checkpoint.latest_complete(exp.run_dir)
        return None if good is None else os.path.join(checkpoint.checkpoint_root(exp.run_dir), checkpoint.tag_for(good))

    stop.training_started()
    t_start = time.time()
    while step < exp.train.steps:
        t0 = time.time()
        phase_idx, phase = exp.phase_at(step)
        step_objs = objectives[phase_idx]
        batches = {src: [b.to(device) for b in loaders[src].next_global_step()]
                   for src in sorted({o.objective.source for o in step_objs})}
        t_data = time.time() - t0
        losses, accuracy, lr = train_step(engine, step_objs, batches, world, exp.train.grad_accum)
        step += 1
        step_tokens = world * sum(int((b.doc_ids >= 0).sum()) for bs in batches.values() for b in bs)
        tokens_seen += step_tokens
        dt = time.time() - t0
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
        guard.count(losses, grad_norm, engine.skipped_steps)
        scalars = {f"loss/{n}": v for n, v in losses.items()} | {f"acc/{n}": v for n, v in accuracy.items()}
        scalars |= {"optim/lr": lr, "optim/grad_norm": grad_norm, "optim/skipped_steps": engine.skipped_steps,
                    "perf/tokens_per_s": step_tokens / dt, "perf/data_wait": t_data / dt,
                    "perf/mfu": flops_tok * step_tokens / dt / (world * peak * 1e12) if peak else 0.0,
                    "perf/mem_gib": memory_gib(), "progress/tokens_seen": tokens_seen, "progress/phase": phase_idx}
        metrics.log(step, scalars, phase.name)
        guard.check(step, losses, grad_norm, last_good)
        signalled = stop.agreed(device)
        stopping = signalled or step == exp.train.stop_at_step
        if guard.healthy and (step % exp.checkpoint.every == 0 or stopping or step == exp.train.steps):
            save()
        if stopping:
            if rank == 0:
                why = f" on {stop.reason or 'the stop request of another rank'}" if signalled else ""
                saved = "checkpointed" if last_saved == step else f"not checkpointed: the newest step was bad; " \
                                                                   f"the last good checkpoint is {last_good()}"
                print(f"stopped at step {step} ({saved}){why}; start the same command again to resume", flush=True)
            break

    if last_saved != step and guard.healthy:
        save()
    summary = {"steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(time.time() - t_start, 1),
               "run_dir": exp.run_dir}
    if step == exp.train.steps and exp.train.export_hf and guard.healthy:
        summary["hf_export"] = export_hf(engine, lm, tokenizer, os.path.join(exp.run_dir, "hf"),
                                         from_experiment(to_dict(exp), tokenizer))
    metrics.close(summary)
    for loader in loaders.values():
        loader.close()
    return summary
