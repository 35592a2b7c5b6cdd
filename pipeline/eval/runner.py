"""Run a list of tasks on one model and collect the results with the configuration that produced them."""

from __future__ import annotations

import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import transformers

from pipeline.eval.load import load_model
from pipeline.eval.registry import TASKS, task_options
from pipeline.eval.task import EvalContext


@dataclass
class EvalConfig:
    model: str
    tasks: list[str]
    data_dir: str
    overrides: list[str] = field(default_factory=list)  # TASK.KEY=VALUE
    attention: str = "auto"
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    batch_size: int = 16
    seed: int = 0
    progress: bool = True


def failure(error: Exception) -> dict:
    """Why a task failed, in one line each: the error and the innermost frame that raised it (no traceback)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return {"error": f"{type(error).__name__}: {error}",
            "where": f"{frame.filename}:{frame.lineno} in {frame.name}"}


def evaluate(config: EvalConfig) -> dict:
    """``{"config", "model", "options", "results", "headline", "failed", "environment"}``. Bad options or model
    stop the run before any task; a task that fails is recorded in ``failed`` (``failure``) and the others run."""
    options = task_options(config.tasks, config.overrides)  # before loading the model: bad options fail fast
    model = load_model(config.model, attention=config.attention, tokenizer=config.tokenizer, device=config.device,
                       dtype=config.dtype)
    ctx = EvalContext(model, config.data_dir, config.batch_size, config.progress, config.seed)
    results, headline, seconds, failed = {}, {}, {}, {}
    for name in config.tasks:
        torch.manual_seed(config.seed)
        start = time.time()
        if config.progress:
            print(f"[evaluate] {name}: {TASKS[name].description}", file=sys.stderr, flush=True)
        try:
            results[name] = TASKS[name].run(ctx, options[name])
            headline.update(TASKS[name].headline(results[name]))
        except Exception as e:  # any error: the finished tasks' results must still be written
            results.pop(name, None)
            failed[name] = failure(e)
        seconds[name] = round(time.time() - start, 2)
    return {"config": asdict(config), "model": model.describe(),
            "options": {name: asdict(opts) for name, opts in options.items()},
            "results": results, "headline": headline, "failed": failed, "seconds": seconds,
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "argv": sys.argv}}
