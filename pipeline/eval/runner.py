"""Run a list of tasks on one model and collect the results with the configuration that produced them
(:class:`pipeline.eval.results.EvalResults`, for ``launch/evaluate.py`` and ``make reproduce`` alike)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import torch
import transformers

from pipeline.config import ConfigError
from pipeline.constraints import lock_identity
from pipeline.eval.config import EvalConfig
from pipeline.eval.data import DataError
from pipeline.eval.encode import MAX_TOKENS
from pipeline.eval.load import ModelError, load_model
from pipeline.eval.ranks import init_from_env, world
from pipeline.eval.registry import TASKS, task_options
from pipeline.eval.results import EvalResults
from pipeline.eval.task import EvalContext
from pipeline.export.model_index import refresh_card
from pipeline.io import REPO, repo_relative
from pipeline.model.build import DTYPES
from pipeline.run_dir import RunDir


def failure(error: Exception) -> dict:
    """Why a task failed, in one line each: the error and the innermost frame that raised it (no traceback)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return {"error": f"{type(error).__name__}: {error}",
            "where": f"{frame.filename}:{frame.lineno} in {frame.name}"}


@contextmanager
def no_library_bars():
    """The libraries' own bars off (transformers' "Loading weights" and the export's "Writing model shards", the
    hub's, datasets'), then back as they were. Without datasets (the lent GPU's image has none, and no local task
    needs it) there are no bars of its to turn off."""
    try:
        import datasets
    except ImportError:
        datasets = None

    was = transformers.utils.logging.is_progress_bar_enabled(), bool(datasets and datasets.is_progress_bar_enabled())
    transformers.utils.logging.disable_progress_bar()
    if datasets:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was[0]:
            transformers.utils.logging.enable_progress_bar()
        if was[1]:
            datasets.enable_progress_bars()


def evaluate(config: EvalConfig, root: str = REPO) -> EvalResults:
    """Bad options or model stop the run before any task; a task that fails is recorded in ``failed``
    (``failure``) and the others run. The results name paths relative to ``root``, the results root
    (:mod:`pipeline.eval.description`)."""
    options = task_options(config.tasks, config.overrides)  # before loading the model: bad options fail fast
    with nullcontext() if config.progress else no_library_bars():  # progress False: no bar at all
        return _evaluate(config, options, root)


def _evaluate(config: EvalConfig, options: dict, root: str) -> EvalResults:
    model = load_model(config.model, attention=config.attention, tokenizer=config.tokenizer, device=config.device,
                       dtype=config.dtype, step=config.step)
    hidden = model.lm.config.hidden_size
    if config.dim is not None and config.dim > hidden:
        raise ConfigError(f"--dim {config.dim}: the model's embeddings have {hidden} dims; pass at most {hidden}"
                          + (f", e.g. one of its trained {list(model.record.matryoshka_dims)}"
                             if model.record.matryoshka_dims else ""))
    ctx = EvalContext(model, config.data_dir, config.batch_size, config.progress, config.seed, config.max_tokens,
                      config.dim)
    results, headline, seconds, failed = {}, {}, {}, {}
    for name in config.tasks:
        torch.manual_seed(config.seed)
        start = time.time()
        if config.progress:
            print(f"[evaluate] {name}: {TASKS[name].spec.description}", file=sys.stderr, flush=True)
        try:
            results[name] = TASKS[name].run(ctx, options[name])
            headline.update(TASKS[name].spec.headline(results[name]))
        except Exception as e:  # any error: the finished tasks' results must still be written
            results.pop(name, None)
            failed[name] = failure(e)
        seconds[name] = round(time.time() - start, 2)
    return EvalResults(config=config.recorded(root), model=model.describe(root),
                       options={name: asdict(opts) for name, opts in options.items()},
                       results=results, headline=headline, failed=failed, seconds=seconds,
                       environment={"python": platform.python_version(), "torch": torch.__version__,
                                    "transformers": transformers.__version__, "cpu": cpu(),
                                    "argv": [repo_relative(a) if os.path.isabs(a) else a for a in sys.argv],
                                    "lock": lock_identity()})


def cpu() -> str:
    """The CPU's model and the kernels torch picks on it (e.g. ``AVX512``): the same wheels give the same numbers
    bit for bit only on the same pair, since other kernels sum floats in another order (docs/training.md)."""
    name = platform.processor()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return f"{name or 'unknown'} ({torch.backends.cpu.get_cpu_capability()})"


def _refresh_card(results: EvalResults) -> None:
    """The evaluated export of a run's step shows the run's results of that step in its model card: those read as
    its record says (an evaluation with another --attention is left out). The results' paths are the repository's
    (``evaluate``'s default root)."""
    model = results.model
    if model.run_dir and model.step is not None:
        hf_dir = os.path.join(REPO, model.hf_dir)
        n = refresh_card(RunDir(os.path.join(REPO, model.run_dir)), hf_dir, model.step, model.record.attention)
        if n:
            print(f"model card: {n} results in the model-index of {os.path.join(model.hf_dir, 'README.md')}")


USAGE = """Evaluate a run or an HF model on any of the evaluation tasks and write the results as JSON:

    python launch/evaluate.py --model RUN_DIR|HF_DIR --tasks sts,repetition --data-dir DIR [--out results.json]
        [--set TASK.KEY=VALUE ...] [--attention auto|causal|bidirectional] [--device cpu|cuda] [--dtype auto|fp32|bf16]
        [--max-tokens N] [--batch-size N] [--dim N]

Without --out, a run directory's results go to RUN_DIR/eval/results.json, where launch/report.py reads them, and
the model card of the run's export they evaluated gets them as its model-index (docs/export.md);
``--step N`` evaluates the run's complete checkpoint of step N instead (RUN_DIR/eval/stepNNNNNNNN/results.json).
Under ``torchrun --nproc-per-node N`` every rank runs every task, encode() splits its texts over the ranks (each on
its own GPU), every rank gets all embeddings, and rank 0 writes the results (docs/evaluation.md).
A task that fails does not lose the others: the finished tasks' results are written, and each failed task is named
with its error (exit status 1; 2 when nothing finished, and then nothing is written).
``--list`` prints the tasks. Data layouts, options and metrics: docs/evaluation.md.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="run directory (runs/<name>) or HF model directory")
    p.add_argument("--tasks", help="comma-separated task names (see --list)")
    p.add_argument("--data-dir", default="data/eval", help="root of the evaluation data (docs/evaluation.md)")
    p.add_argument("--out", help="results JSON (default for a run directory: RUN_DIR/eval/results.json)")
    p.add_argument("--set", action="append", default=[], metavar="TASK.KEY=VALUE", help="task option (YAML value)")
    p.add_argument("--attention", default="auto", choices=["auto", "causal", "bidirectional"],
                   help="attention of encoders (auto: from the run's training; causal for a bare HF directory)")
    p.add_argument("--tokenizer", help="tokenizer directory, when the model directory has none")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights' dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="padded tokens per batch of embedding and probing tasks (texts are batched by length)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per batch of generation and intrinsic tasks")
    p.add_argument("--dim", type=int, help="embedding tasks keep the first N dims of each embedding (a Matryoshka "
                   "model's; default: the export's truncate_dim, else all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, help="evaluate this complete checkpoint of the run directory (e.g. one "
                   "checkpoint.keep_every kept); results default to RUN_DIR/eval/stepNNNNNNNN/results.json")
    p.add_argument("--no-progress", action="store_true", help="draw no progress bar (the libraries' neither)")
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    args = p.parse_args(argv)

    if args.list:
        for spec in (task.spec for task in TASKS.values()):
            print(f"{spec.name:22} DATA_DIR/{spec.family:22} {spec.description}")
        return 0
    if not args.model or not args.tasks:
        p.error("--model and --tasks are required (or --list)")
    run = RunDir(args.model)
    out = args.out or (run.eval_results(step=args.step) if run.exists() else None)
    if out is None:
        p.error("--out is required when --model is not a run directory")
    if args.max_tokens < 1:
        p.error(f"--max-tokens {args.max_tokens}: a batch needs room for at least one row; pass a positive budget")
    if args.dim is not None and args.dim < 1:
        p.error(f"--dim {args.dim}: an embedding keeps at least one dim; pass a positive number")
    device = init_from_env(args.device)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if device.startswith("cuda") else "fp32"
    config = EvalConfig(model=args.model, tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                        data_dir=args.data_dir, overrides=args.set, attention=args.attention,
                        tokenizer=args.tokenizer, device=device, dtype=dtype, batch_size=args.batch_size,
                        seed=args.seed, progress=not args.no_progress and world()[0] == 0, step=args.step,
                        max_tokens=args.max_tokens, dim=args.dim)
    try:
        results = evaluate(config)
    except (ConfigError, DataError, ModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in results.failure_lines():
        print(f"error: {line}", file=sys.stderr)
    if world()[0] != 0:  # rank 0 writes and reports; the others computed the same results
        return 1 if results.failed else 0 if results.results else 2
    if not results.write(out):
        print(f"error: no task finished; {out} was not written", file=sys.stderr)
        return 2
    _refresh_card(results)
    for key, value in results.headline.items():
        print(f"{key:32} {value:.4g}")
    finished = ", ".join(results.results)
    print(f"wrote {out} ({finished}" + (f"; failed: {', '.join(results.failed)})" if results.failed else ")"))
    return 1 if results.failed else 0
