"""The experiment's fields as they load (pipeline/experiment/): the run's name, errors that name the key, the
phases' boundaries, and the batch warmup's fields checked against the world size (pipeline/train/batch_warmup.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pipeline.config import ConfigError
from pipeline.data.loading.order import BatchWarmup
from pipeline.experiment import load_experiment, phase_at
from pipeline.io import REPO
from pipeline.train.batch_warmup import batch_warmup
from pipeline.train.phases import build_objectives


def test_run_dir_names_the_run():
    assert (load_experiment(None).name, load_experiment(None).run_dir) == ("sample-tiny-clm", "runs/sample-tiny-clm")
    assert load_experiment(None, ["run_dir=/tmp/runs/mntp-try2/"]).name == "mntp-try2"
    assert load_experiment(None, ["name=x", "run_dir=/tmp/y"]).name == "x"  # an explicit name wins


def test_batch_warmup_config_errors_name_the_field():
    warm = ["train.micro_batch=2", "train.grad_accum=4", "train.steps=20", "train.batch_warmup.steps=8"]
    with pytest.raises(ConfigError, match=r"^train.batch_warmup.start: 0.0 is out of range; it must be in \(0, 1\]$"):
        load_experiment(None, [*warm, "train.batch_warmup.start=0"])
    with pytest.raises(ConfigError, match="^train.batch_warmup.multiple: 3 samples are not whole micro-batches of "
                                          "train.micro_batch 2; set a multiple of micro_batch x the world size$"):
        load_experiment(None, [*warm, "train.batch_warmup.multiple=3"])
    with pytest.raises(ConfigError, match=r"^train.batch_warmup.steps: 8 steps outlast the first phase \(5 steps\)"):
        load_experiment(None, [*warm, "phases=[{share: 0.25, objectives: [{name: clm}]}, "
                                      "{share: 0.75, objectives: [{name: mlm}]}]"])
    t = load_experiment(None, [*warm, "train.batch_warmup.multiple=6"]).train
    with pytest.raises(ConfigError, match="^train.batch_warmup.multiple: 6 samples do not make whole micro-batches "
                                          "of 2 on each of 2 ranks within the global batch of 16; set it to a "
                                          "multiple of 4 up to 16"):
        batch_warmup(t, 2)
    assert batch_warmup(t, 1).granule == 3 and batch_warmup(t, 3).granule == 3  # 6 samples: 3 micro-batches of 2
    default = load_experiment(None, warm).train
    assert batch_warmup(default, 2) == BatchWarmup(full=8, start=0.25, steps=8, granule=2)  # micro_batch x world
    assert batch_warmup(load_experiment(None, []).train, 2) is None  # steps 0: no warmup


def test_experiment_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"phases.0.objectives.0.name: 'bert' is not allowed; choose one of"):
        load_experiment(None, ["phases=[{objectives: [{name: bert}]}]"])
    with pytest.raises(ConfigError, match=r"train.stepz: unknown key"):
        load_experiment(None, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="shares must sum to 1"):
        load_experiment(None, ["phases=[{share: 0.5, objectives: [{name: clm}]}]"])
    exp = load_experiment(None, ["train.steps=100", "phases=[{share: 0.25, objectives: [{name: clm}]}, "
                                 "{share: 0.75, objectives: [{name: mlm, ratio: 0.4}]}]"])
    assert exp.phase_starts() == [0, 25]
    assert [exp.phases[phase_at(exp.phase_starts(), s)].name for s in (24, 25)] == ["clm", "mlm"]


def test_global_batch_is_micro_batch_times_grad_accum_times_world():
    """One product for DeepSpeed's train_batch_size, preflight's checks and the planner: a phase's or the units' own
    micro-batch replaces train.micro_batch, 0 (unset) keeps it."""
    t = load_experiment(None, ["train.micro_batch=3", "train.grad_accum=2"]).train
    assert [t.global_batch(1), t.global_batch(4), t.global_batch(4, 5), t.global_batch(4, 0)] == [6, 24, 40, 24]


# each ends in one config error whose message suggests a fix as KEY=VALUE
SUGGESTING = {
    "ratio schedule": ["phases=[{objectives: [{name: mlm, ratio: 0.3, ratio_schedule: {shape: linear}}]}]"],
    "loss names": ["phases=[{objectives: [{name: mlm}, {name: mlm, ratio: 0.2}]}]"],
    "mask token": ["phases=[{objectives: [{name: mntp, mask_token: '<nope>'}]}]"],
    "phase micro-batch": ["data.seq_len=64", "train.micro_batch=3", "phases=[{share: 0.5, objectives: [{name: clm}]}, "
                          "{share: 0.5, seq_len: 128, objectives: [{name: clm}]}]"],
    "one order": ["train.micro_batch=3", "phases=[{share: 0.5, objectives: [{name: clm}]}, "
                  "{share: 0.5, micro_batch: 2, objectives: [{name: clm}]}]"],
    "supervised": ["phases=[{objectives: [{name: supervised}]}]", "train.grad_accum=2"],
    "evaluator": ["eval.every=10", "eval.holdout=0.01", "eval.evaluators=[{task: sts}]"],
}
SUGGESTION = re.compile(r"(?<![\w.\]])([a-z_]+(?:\[\d+\]|\.\w+)+)=(\S+?)(?=[\s,;)]|$)")


@pytest.mark.parametrize("overrides", SUGGESTING.values(), ids=SUGGESTING)
def test_every_suggested_setting_is_one_set_takes(overrides, tokenizer):
    """Issue 51, item 6: the mask-token error suggested phases[0].objectives[0].mask_token=..., which --set
    refused (only phases.0.... indexed a list). Each suggestion the config's errors print, fed back through --set
    as printed, fixes the error it came with."""
    def error(overrides: list[str]) -> str | None:
        try:
            exp = load_experiment(None, overrides)
            for i, phase in enumerate(exp.phases):  # the mask token and loss names are checked as objectives build
                build_objectives(phase, tokenizer, f"phases[{i}]")
        except ConfigError as e:
            return str(e)
        return None

    message = error(overrides)
    suggestions = [m.group(0) for m in SUGGESTION.finditer(message or "")]
    assert suggestions, message
    for suggestion in suggestions:
        assert error([*overrides, suggestion]) is None, (message, suggestion)


def test_a_config_refusal_imports_no_torch_transformers_or_deepspeed():
    """A refusal is as quick as parsing: loading and checking an experiment (every objective's config, a preset,
    LoRA's targets; the launcher's own path too) imports none of the ~6 s of torch, transformers and DeepSpeed."""
    code = """if True:
        import sys
        from pipeline.config import ConfigError
        from pipeline.experiment import load_experiment
        from pipeline.train.entry import main
        for path in ("experiments/magnet/magnet.yaml", "experiments/llm2vec/supervised-lora.yaml",
                     "experiments/llm2vec/simcse-lora.yaml", "experiments/ettin/ettin-210m.yaml"):
            load_experiment(path, ["train.log_every=1"])  # loads whole: its objectives' configs, checked
            try:
                load_experiment(path, ["train.steps=0"])
                raise SystemExit(path + ": train.steps=0 was not refused")
            except ConfigError:
                pass
        assert main(["--set", "train.steps=0"]) == 2
        print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "deepspeed"}))
    """
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]", run.stdout
