"""Evaluators during training (``eval.evaluators``) and ``checkpoint.keep_best``: the config's one-line errors and the
derived mode, the best step spared by the keep-last rotation and carried through a resume (in process, the real
checkpoint path on a fake engine), and a 2-rank ZeRO-3 run under the ``deepspeed`` launcher whose logged scores
equal ``launch/evaluate.py``'s on the same checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
import warm
from helpers import REPO, launch_training, logged_steps
from test_trainer import FakeEngine

from pipeline.config import ConfigError
from pipeline.eval import repetition
from pipeline.eval.load import ModelError, resolve
from pipeline.experiment import SAMPLE_DIR, CheckpointConfig, load_experiment
from pipeline.model.build import build_model, model_spec
from pipeline.run_dir import RunDir
from pipeline.tasks import SPECS
from pipeline.train.checkpoint import Best, Checkpointer
from pipeline.train.keep_best import KeepBest
from pipeline.train.module import TrainModule
from pipeline.train.plan import checkpoint_spec
from pipeline.train.preflight import preflight
from pipeline.train.run_setup import ResumePoint
from pipeline.train.state import TrainState

FIXTURES = os.path.join(REPO, "tests", "fixtures", "eval")
STS = os.path.join(FIXTURES, "sts", "stsb.tsv")
RETRIEVAL = os.path.join(FIXTURES, "retrieval", "pairs", "test.jsonl")
REPETITION = os.path.join(FIXTURES, "repetition", "wiki.jsonl")
INFILLING = os.path.join(FIXTURES, "infilling", "wiki.jsonl")
VALIDATION = ["eval.every=2", "eval.holdout=0.01", "checkpoint.every=2"]


def evaluators(*entries: str) -> str:
    return f"eval.evaluators=[{', '.join(entries)}]"


def test_evaluators_and_keep_best_parse_with_the_derived_mode():
    exp = load_experiment(None, [*VALIDATION, evaluators(f"{{task: sts, datasets: [{STS}], options: {{max_length: 64}}}}",
                                                          f"{{task: repetition, datasets: [{REPETITION}]}}"),
                                 "checkpoint.keep_best=eval/sts_avg"])
    assert [e.task for e in exp.eval.evaluators] == ["sts", "repetition"]
    assert exp.eval.evaluators[0].task_options("x").max_length == 64 and exp.keep_best_mode() == "max"
    for metric, mode in (("eval/rep_sen/wiki", "min"), ("eval/loss/clm", "min"), ("eval/probe_acc/mlm15", "max")):
        assert load_experiment(None, [*VALIDATION, f"checkpoint.keep_best={metric}",
                                      evaluators(f"{{task: repetition, datasets: [{REPETITION}]}}")]
                               ).keep_best_mode() == mode
    assert load_experiment(None, [*VALIDATION, "checkpoint.keep_best=eval/loss/clm",
                                  "checkpoint.keep_best_mode=max"]).keep_best_mode() == "max"


@pytest.mark.parametrize("overrides, message", [
    ([evaluators(f"{{task: sts, datasets: [{STS}]}}")], "eval.evaluators: they run at each validation; set eval.every"),
    ([*VALIDATION, evaluators("{task: mlm, datasets: [x]}")],
     "eval.evaluators[0].task: 'mlm' does not run during training; choose one of ['sts', "),
    ([*VALIDATION, evaluators("{task: sts}")], "eval.evaluators[0].datasets: empty; name the sts task's data files"),
    ([*VALIDATION, evaluators(f"{{task: sts, datasets: [{STS}], options: {{pooling: max}}}}")],
     "eval.evaluators[0].options.pooling: 'max' is not allowed; choose one of ['mean', 'last', 'weighted_mean']"),
    ([*VALIDATION, evaluators(f"{{task: sts, datasets: [{STS}], options: {{poling: mean}}}}")],
     "eval.evaluators[0].options.poling: unknown key; did you mean eval.evaluators[0].options.pooling?"),
    (["checkpoint.keep_best=eval/loss/clm"], "checkpoint.keep_best: eval/loss/clm is measured by the validation; set "
                                             "eval.every"),
    (["eval.every=3", "eval.holdout=0.01", "checkpoint.every=2", "checkpoint.keep_best=eval/loss/clm"],
     "checkpoint.keep_best: eval.every 3 is not a multiple of checkpoint.every 2, so a best step could have no "
     "checkpoint; set eval.every to a multiple, e.g. eval.every=4"),
    ([*VALIDATION, "checkpoint.keep_best=eval/sts_avg"], "checkpoint.keep_best: 'eval/sts_avg' is not a validation "
                                                         "scalar this run logs; name one of ['eval/loss/...', "),
    ([*VALIDATION, "checkpoint.keep_best=loss/clm", "checkpoint.keep_best_mode=min"],
     "checkpoint.keep_best: 'loss/clm' is not a validation scalar this run logs"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_preflight_refuses_a_missing_data_file(build_shards, tmp_path):
    """At the start, not when the experiment loads: a finished run's experiment.json loads without its files."""
    shards = build_shards(inputs=(os.path.join(SAMPLE_DIR, "train", "chunk1", "example_train_0.jsonl.zst"),),
                          samples_per_shard=512)
    exp = load_experiment(None, [*VALIDATION, f"data.shards={shards}", "data.seq_len=64", f"run_dir={tmp_path / 'run'}",
                                 evaluators(f"{{task: sts, datasets: [{STS}, no/such.tsv]}}")])
    with pytest.raises(ConfigError) as e, preflight(exp, rank=0, world=1):
        pass
    assert str(e.value) == ("eval.evaluators[0].datasets[1]: no/such.tsv: no such file; name an existing sts file "
                            "(relative to the directory training starts in)")


def _checkpointer(run: RunDir, engine: FakeEngine, mode: str, metric: str = "eval/sts_avg") -> Checkpointer:
    cfg = CheckpointConfig(every=2, keep_last=1, keep_best=metric, keep_best_mode=mode)
    return Checkpointer(engine, run, checkpoint_spec(cfg, KeepBest(metric, mode, (0,)) if metric else None), {})


def _engine() -> FakeEngine:
    torch.manual_seed(0)
    return FakeEngine(TrainModule(build_model(model_spec("tiny", 64, pad_token_id=0, bos_token_id=1, eos_token_id=2))))


@pytest.mark.parametrize("mode, best", [("max", 4), ("min", 2)])
def test_the_best_checkpoint_survives_the_rotation_and_a_resume(tmp_path, mode, best):
    """keep_last 1: each save prunes the older checkpoints but the best one; a resume knows the best again."""
    engine, run = _engine(), RunDir(str(tmp_path / "run"))
    checkpoints, state = _checkpointer(run, engine, mode), TrainState({})
    scores = {2: 0.30, 4: 0.90, 6: 0.50, 8: float("nan"), 10: 0.40}
    for step, score in scores.items():
        state.step = step
        checkpoints.observe(step, 0, {"eval/sts_avg": score, "eval/loss/clm": 1.0})
        checkpoints.save(state)
        assert run.complete_steps() == sorted({checkpoints.best.step, step}), step
    assert checkpoints.best == Best(best, scores[best])
    resumed = _checkpointer(run, engine, mode)
    assert resumed.resume(TrainState({}), ResumePoint(10, 1)) and resumed.best == Best(best, scores[best])
    with pytest.raises(ValueError, match=r"checkpoint.keep_best: eval/sts_avg was not logged at step 12; the "
                                         r"validation logs \['eval/loss/clm'\]"):
        resumed.observe(12, 0, {"eval/loss/clm": 1.0})


@pytest.mark.parametrize("now", ["eval/loss/clm", "eval/sts_avg min", ""])
def test_a_resume_after_keep_best_changed_forgets_the_old_best(tmp_path, now):
    """The saved best names its metric and direction (issue 55, item 3): after a change (another metric, the other
    direction, keep_best off) it is neither compared with the new metric's values, nor spared from the rotation,
    nor exported as hf-best."""
    engine, run = _engine(), RunDir(str(tmp_path / "run"))
    checkpoints, state = _checkpointer(run, engine, "max"), TrainState({})
    for step, score in ((2, 0.9), (4, 0.1)):
        state.step = step
        checkpoints.observe(step, 0, {"eval/sts_avg": score, "eval/loss/clm": 5.0 - step})
        checkpoints.save(state)
    assert checkpoints.best == Best(2, 0.9) and run.complete_steps() == [2, 4]
    metric, mode = (now.split() + ["min"])[:2] if now else ("", "max")
    resumed, state = _checkpointer(run, engine, mode, metric), TrainState({})
    assert resumed.resume(state, ResumePoint(4, 1)) and resumed.best is None
    state.step = 6
    resumed.observe(6, 0, {"eval/sts_avg": 0.5, "eval/loss/clm": 2.0})
    resumed.save(state)
    assert run.complete_steps() == [6]  # step 2, the old best, is pruned by the rotation


def test_the_best_checkpoint_is_marked_and_evaluating_its_step_reads_hf_best(tmp_path):
    """Issue 51, item 6: nothing in checkpoints/ said which directory was the best, and ``evaluate.py --step N`` of
    the best step exported a copy into RUN/eval/hf-stepN instead of reading RUN/hf-best, whose card so never got
    the results. Its directory holds BEST, the one mark; hf-best exported since is what evaluating the step reads,
    and once the best moves on, hf-best (of the old best until the run's end exports the new) is not taken for it."""
    engine, run = _engine(), RunDir(str(tmp_path / "run"))
    checkpoints, state = _checkpointer(run, engine, "max"), TrainState({})

    def at(step: int, score: float) -> list[int]:
        state.step = step
        checkpoints.observe(step, 0, {"eval/sts_avg": score})
        checkpoints.save(state)
        return [s for s in run.checkpoint_steps() if os.path.isfile(run.best_mark(s))]

    assert [at(2, 0.3), at(4, 0.9), at(6, 0.5)] == [[2], [4], [4]]
    assert run.best() == {"step": 4, "value": 0.9, "metric": "eval/sts_avg", "mode": "max"}
    with open(run.experiment_json, "w") as f:
        f.write("{}")
    engine.module.lm.save_pretrained(run.hf_best)  # the end of training's export of the best step
    assert resolve(run.path, 4) == (run.hf_best, run.path, 4)
    assert at(8, 0.95) == [8]
    with pytest.raises(ModelError, match="exporting checkpoint step 8 failed"):  # a copy of step 8, not hf-best
        resolve(run.path, 8)
    forgot = _checkpointer(run, engine, "max", metric="")
    assert forgot.resume(TrainState({}), ResumePoint(8, 1)) and forgot.best is None
    state.step = 10
    forgot.save(state)
    assert run.best() is None  # keep_best dropped: the old best is no longer marked


def test_a_phase_that_does_not_log_the_metric_and_a_repetition_with_nothing_to_score_have_no_candidate(tmp_path):
    """A CLM -> MLM run keeping the best eval/loss/clm: phase 1's validations log no CLM loss, and a repetition
    evaluator whose continuations are all too short logs no Rep-4 (its real headline): neither stops the run."""
    run = RunDir(str(tmp_path / "run"))
    clm = Checkpointer(_engine(), run, checkpoint_spec(CheckpointConfig(), KeepBest("eval/loss/clm", "min", (0,))), {})
    clm.observe(2, 0, {"eval/loss/clm": 3.0})
    clm.observe(6, 1, {"eval/loss/mlm": 1.0})
    assert clm.best == Best(2, 3.0)
    short = SPECS["repetition"].headline({"datasets": {"wiki": repetition.repetition_scores(["too short", "also"])}})
    assert "eval/rep_4/wiki" not in {f"eval/{k}" for k in short}
    rep = Checkpointer(_engine(), run,
                       checkpoint_spec(CheckpointConfig(), KeepBest("eval/rep_4/wiki", "min", (0,), True)), {})
    rep.observe(2, 0, {f"eval/{k}": v for k, v in short.items()} | {"eval/loss/clm": 3.0})
    rep.observe(4, 0, {"eval/rep_4/wiki": 0.2})
    assert rep.best == Best(4, 0.2)


def _evaluate(run_dir: str, step: int, tasks: dict[str, list[str]]) -> dict:
    """``launch/evaluate.py`` on the run's checkpoint of ``step``, each task on its files; its results."""
    sets = [f"--set={task}.{option}" for task, options in tasks.items() for option in options]
    proc = warm.run(os.path.join(REPO, "launch", "evaluate.py"), ["--model", run_dir, "--step", str(step), "--tasks",
                    ",".join(tasks), "--no-progress", *sets], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(RunDir(run_dir).eval_results(step=step)) as f:
        return json.load(f)


@pytest.mark.e2e
@pytest.mark.slow  # a 2-rank launch and two evaluations: ~2 min on a busy 2-core machine
def test_a_two_rank_run_logs_the_scores_evaluate_computes_and_exports_the_best(tmp_path, build_shards):
    """ZeRO-3 on 2 CPU ranks through the deepspeed launcher: the STS pairs fit one encode() batch, so rank 1 has
    none of its own and must join rank 0's forward (else the run hangs)."""
    shards = build_shards(inputs=(os.path.join(SAMPLE_DIR, "train", "chunk1", "example_train_0.jsonl.zst"),),
                          samples_per_shard=512)
    run_dir = str(tmp_path / "run")
    tasks = {"sts": [f"datasets=[{STS}]"], "zero_shot_retrieval": [f"datasets=[{RETRIEVAL}]"],
             "repetition": [f"datasets=[{REPETITION}]", "max_examples=3", "decoding.max_new_tokens=8"],
             "infilling": [f"datasets=[{INFILLING}]", "max_examples=3", "generate=2"]}
    entries = [f"{{task: sts, datasets: [{STS}]}}", f"{{task: zero_shot_retrieval, datasets: [{RETRIEVAL}]}}",
               f"{{task: repetition, datasets: [{REPETITION}], options: {{max_examples: 3, decoding: "
               f"{{max_new_tokens: 8}}}}}}",
               f"{{task: infilling, datasets: [{INFILLING}], options: {{max_examples: 3, generate: 2}}}}"]
    proc = launch_training(run_dir, None, "model.init=tiny", f"data.shards={shards}", "data.seq_len=64",
                           "data.build_if_missing=false", "train.steps=6", "train.micro_batch=2", "optim.lr=0.005",
                           "optim.warmup_steps=1", "optim.decay_steps=1", "train.log_every=2", "eval.samples=8",
                           *VALIDATION, "checkpoint.keep_last=1", "checkpoint.keep_best=eval/sts_avg",
                           evaluators(*entries), launcher="deepspeed")
    logged = {step: rec for step, rec in logged_steps(run_dir).items() if "eval/seconds" in rec}
    assert sorted(logged) == [2, 4, 6]
    for rec in logged.values():
        assert {"eval/sts_avg", "eval/sts/stsb", "eval/zs_ndcg_avg", "eval/infill_ppl_magnet/wiki",
                "eval/infill_ppl_causal/wiki", "eval/loss/clm"} <= set(rec)
    best = max(logged, key=lambda s: (logged[s]["eval/sts_avg"], -s))
    assert RunDir(run_dir).complete_steps() == sorted({best, 6})
    assert f"exported the best checkpoint (step {best}) to {RunDir(run_dir).hf_best}" in proc.stdout
    assert os.path.isfile(os.path.join(RunDir(run_dir).hf_best, "config.json"))
    for step in sorted({best, 6}):  # the logged numbers are launch/evaluate.py's on that checkpoint, exactly
        results = _evaluate(run_dir, step, tasks)
        assert results["results"]["repetition"]["datasets"]["wiki"]["continuations"] == 3 and not results["failed"]
        assert {f"eval/{k}": v for k, v in results["headline"].items()} == {
            k: logged[step][k] for k in (f"eval/{h}" for h in results["headline"])}, step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/sts_avg")] == [
        (s, pytest.approx(logged[s]["eval/sts_avg"], rel=1e-6)) for s in (2, 4, 6)]
