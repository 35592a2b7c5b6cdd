"""Evaluate a run or an HF model on any of the evaluation tasks and write the results as JSON:

    python launch/evaluate.py --model RUN_DIR|HF_DIR --tasks sts,repetition --data-dir DIR [--out results.json]
        [--set TASK.KEY=VALUE ...] [--attention auto|causal|bidirectional] [--device cpu|cuda] [--batch-size N]

Without --out, a run directory's results go to RUN_DIR/eval/results.json, where launch/report.py reads them.
A task that fails does not lose the others: the finished tasks' results are written, and each failed task is named
with its error (exit status 1; 2 when nothing finished, and then nothing is written).
``--list`` prints the tasks. Data layouts, options and metrics: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="run directory (runs/<name>) or HF model directory")
    p.add_argument("--tasks", help="comma-separated task names (see --list)")
    p.add_argument("--data-dir", default="data/eval", help="root of the evaluation data (docs/evaluation.md)")
    p.add_argument("--out", help="results JSON (default for a run directory: RUN_DIR/eval/results.json)")
    p.add_argument("--set", action="append", default=[], metavar="TASK.KEY=VALUE", help="task option (YAML value)")
    p.add_argument("--attention", default="auto", choices=["auto", "causal", "bidirectional"],
                   help="attention of encoders (auto: from the run's training; causal for a bare HF directory)")
    p.add_argument("--tokenizer", help="tokenizer directory, when the model directory has none")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    args = p.parse_args(argv)

    from pipeline.config import ConfigError
    from pipeline.eval.data import DataError
    from pipeline.eval.load import ModelError
    from pipeline.eval.registry import TASKS
    from pipeline.eval.runner import EvalConfig, evaluate
    from pipeline.io import write_json_atomic
    from pipeline.run_dir import RunDir

    if args.list:
        for task in TASKS.values():
            print(f"{task.name:22} DATA_DIR/{task.family:22} {task.description}")
        return 0
    if not args.model or not args.tasks:
        p.error("--model and --tasks are required (or --list)")
    run = RunDir(args.model)
    out = args.out or (run.eval_results() if run.exists() else None)
    if out is None:
        p.error("--out is required when --model is not a run directory")
    config = EvalConfig(model=args.model, tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                        data_dir=args.data_dir, overrides=args.set, attention=args.attention,
                        tokenizer=args.tokenizer, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                        seed=args.seed, progress=not args.no_progress)
    try:
        results = evaluate(config)
    except (ConfigError, DataError, ModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, why in results["failed"].items():
        print(f"error: task {name} failed: {why['error']} (raised at {why['where']})", file=sys.stderr)
    if not results["results"]:
        print(f"error: no task finished; {out} was not written", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json_atomic(out, results)
    for key, value in results["headline"].items():
        print(f"{key:32} {value:.4g}")
    finished = ", ".join(results["results"])
    print(f"wrote {out} ({finished}" + (f"; failed: {', '.join(results['failed'])})" if results["failed"] else ")"))
    return 1 if results["failed"] else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
