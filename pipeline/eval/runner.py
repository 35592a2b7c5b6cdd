"""Run a list of tasks on one model and collect the results with the configuration that produced them."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers

from pipeline.eval.model import load_model
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


def evaluate(config: EvalConfig) -> dict:
    """``{"config", "model", "options", "results", "headline", "environment"}``; a task's error stops the run."""
    options = task_options(config.tasks, config.overrides)  # before loading the model: bad options fail fast
    model = load_model(config.model, attention=config.attention, tokenizer=config.tokenizer, device=config.device,
                       dtype=config.dtype)
    ctx = EvalContext(model, config.data_dir, config.batch_size, config.progress, config.seed)
    results, headline, seconds = {}, {}, {}
    for name in config.tasks:
        torch.manual_seed(config.seed)
        start = time.time()
        if config.progress:
            print(f"[evaluate] {name}: {TASKS[name].description}", file=sys.stderr, flush=True)
        results[name] = TASKS[name].run(ctx, options[name])
        headline.update(TASKS[name].headline(results[name]))
        seconds[name] = round(time.time() - start, 2)
    return {"config": asdict(config), "model": model.describe(),
            "options": {name: asdict(opts) for name, opts in options.items()},
            "results": results, "headline": headline, "seconds": seconds,
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "argv": sys.argv}}
