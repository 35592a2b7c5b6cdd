"""evaluate.py then report.py end to end on real smoke runs of the trainer (ZeRO-3 on CPU, gloo): the run's newest
checkpoint is exported on the fly, the results land in RUN/eval/results.json, and the report's tables and PNGs are
written (the PNGs are decoded and must show something)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest
import torch
import warm
from PIL import Image
from test_eval_tasks import make_data_dir
from test_train_e2e import launch

from pipeline.constraints import lock_identity

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
SMOKE = ["train.steps=6", "optim.warmup_steps=1", "optim.decay_steps=2", "checkpoint.every=6", "train.log_every=2"]
GRID = {  # name -> phases: the MLM-vs-CLM axes (CLM share, masking ratio)
    "clm": "[{objectives: [{name: clm}]}]",
    "clm50-mlm40": "[{share: 0.5, objectives: [{name: clm}]}, {share: 0.5, objectives: [{name: mlm, ratio: 0.4}]}]",
    "mlm20": "[{objectives: [{name: mlm, ratio: 0.2}]}]",
}
FAST_TASKS = ["perplexity", "mlm", "sts", "repetition"]


def cli(script: str, *args: str) -> subprocess.CompletedProcess:
    return warm.run(os.path.join(REPO, "launch", script), args, env={**os.environ, "OMP_NUM_THREADS": "1"})


def train(root, data_dir: str, name: str, *overrides: str, nproc: int = 1) -> str:
    run_dir = os.path.join(str(root), name)
    launch(run_dir, os.path.join(data_dir, "heldout"), "tiny", *SMOKE, f"name={name}", f"phases={GRID[name]}",
           *overrides, nproc=nproc)
    return run_dir


def evaluate(run_dir: str, data_dir: str, tasks: list[str], *sets: str) -> dict:
    args = ["--model", run_dir, "--tasks", ",".join(tasks), "--data-dir", data_dir, "--batch-size", "8",
            "--no-progress", "--set", "perplexity.max_batches=2", "--set", "mlm.max_batches=2",
            "--set", "repetition.decoding.max_new_tokens=16"]
    for s in sets:
        args += ["--set", s]
    proc = cli("evaluate.py", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run_dir, "eval", "results.json")) as f:
        return json.load(f)


def bars(stderr: str) -> list[str]:
    """The lines of ``stderr`` a tqdm bar drew ("Loading weights: 100%|...| 21/21 [00:00<00:00, 14387.52it/s]")."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if re.search(r"\d+%\||it/s\]|s/it\]", line)]


ZERO_TO_FP32_BARS = ("Loading checkpoint shards", "Gathering sharded weights")


def check_png(path: str) -> None:
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.float32)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 1.0, path  # not blank


def report(runs: list[str], out: str) -> str:
    proc = cli("report.py", *runs, "--out", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for png in ("loss_curves.png", "metrics_vs_clm_share.png", "metrics_vs_mask_ratio.png"):
        check_png(os.path.join(out, png))
    with open(os.path.join(out, "report.md")) as f:
        return f.read()


@pytest.mark.e2e
@pytest.mark.slow  # ~1 min of launches: the slow suite keeps make test under 20 min
def test_evaluate_then_report_on_a_smoke_run(tmp_path):
    data_dir = make_data_dir(str(tmp_path / "data"))
    run_dir = train(tmp_path / "runs", data_dir, "clm50-mlm40", "train.export_hf=false")
    results = evaluate(run_dir, data_dir, FAST_TASKS, "sts.datasets=[sts/stsb.tsv]",
                       "repetition.datasets=[repetition/roc.jsonl]")
    assert os.path.isfile(os.path.join(run_dir, "eval", "hf-step00000006", "config.json"))  # exported on the fly
    assert results["model"]["step"] == 6 and results["model"]["attention"] == "bidirectional"  # last phase: MLM
    assert results["config"]["tasks"] == FAST_TASKS and results["options"]["mlm"]["ratio"] == 0.3
    assert results["results"]["mlm"]["ratio"] == 0.3 and 0 < results["headline"]["ppl"] < 1e5
    assert set(results["headline"]) >= {"ppl", "mlm_acc", "sts_avg", "sts/stsb"}
    assert results["results"]["repetition"]["datasets"]["roc"]["continuations"] == 4
    assert results["environment"]["cpu"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")  # which kernels
    assert results["environment"]["lock"] == lock_identity()  # which versions: the lock, and where they departed

    text = report([run_dir], str(tmp_path / "report"))
    assert "| clm50-mlm40 | clm -> mlm | tiny | 6 | 0.50 | 0.4 |" in text
    assert "## LLM2Vec" in text and "## Every evaluated number" in text
    assert "## Should We Still Pretrain" not in text  # no fine-tuning numbers yet: no empty table
    assert os.path.isfile(tmp_path / "report" / "magnet.md")

    # a failing task loses nothing: the finished task's results are written, the failure is named, no traceback
    bad_file = tmp_path / "bad.tsv"
    bad_file.write_text("a\tb\nx\ty\nz\tw\n")
    out = str(tmp_path / "partial.json")
    partial = cli("evaluate.py", "--model", run_dir, "--tasks", "sts,perplexity", "--data-dir", data_dir,
                  "--no-progress", "--set", "perplexity.max_batches=1", "--set", f"sts.datasets=[{bad_file}]",
                  "--out", out)
    assert partial.returncode == 1 and "Traceback" not in partial.stderr, partial.stderr[-3000:]
    assert f"error: task sts failed: DataError: {bad_file}" in partial.stderr
    assert "(perplexity; failed: sts)" in partial.stdout
    with open(out) as f:
        written = json.load(f)
    assert set(written["results"]) == {"perplexity"} and "ppl" in written["headline"]
    assert "first sentence" in written["failed"]["sts"]["error"] and "data.py" in written["failed"]["sts"]["where"]
    bad = cli("evaluate.py", "--model", run_dir, "--tasks", "sts", "--data-dir", str(tmp_path / "none"))
    assert bad.returncode == 2 and "no such directory" in bad.stderr and "was not written" in bad.stderr
    with open(os.path.join(run_dir, "eval", "results.json")) as f:
        assert json.load(f)["results"].keys() == set(FAST_TASKS)  # the earlier results were not overwritten


@pytest.mark.e2e
def test_a_kept_checkpoint_is_evaluated_beside_the_final_model_not_instead(tmp_path):
    """``--step N`` reads the checkpoint ``checkpoint.keep_every`` kept (metrics against training steps); its
    results go to RUN/eval/stepN/, which the report of the run's final model does not read."""
    from pipeline.eval.report.runs import load_run

    data_dir = make_data_dir(str(tmp_path / "data"))
    run_dir = train(tmp_path / "runs", data_dir, "clm", "checkpoint.every=2", "checkpoint.keep_last=1",
                    "checkpoint.keep_every=4", "train.export_hf=false")
    ppl = ["--tasks", "perplexity", "--data-dir", data_dir, "--no-progress", "--set", "perplexity.max_batches=2"]
    early = cli("evaluate.py", "--model", run_dir, "--step", "4", *ppl)
    assert early.returncode == 0, early.stderr[-3000:]
    # the checkpoint's export on the fly draws none either, but DeepSpeed's zero_to_fp32, which has no switch
    assert [b for b in bars(early.stderr) if not b.startswith(ZERO_TO_FP32_BARS)] == []
    assert cli("evaluate.py", "--model", run_dir, *ppl).returncode == 0
    with open(os.path.join(run_dir, "eval", "results.json")) as f:
        final = json.load(f)
    with open(os.path.join(run_dir, "eval", "step00000004", "results.json")) as f:
        at_4 = json.load(f)
    assert (at_4["model"]["step"], final["model"]["step"]) == (4, 6) and at_4["config"]["step"] == 4
    assert at_4["headline"]["ppl"] != final["headline"]["ppl"]  # another model
    assert load_run(run_dir).headline == final["headline"]  # the report reads the final model's results only
    pruned = cli("evaluate.py", "--model", run_dir, "--step", "2", *ppl)  # neither kept nor among the newest
    assert pruned.returncode == 2 and "no complete checkpoint of step 2; its complete steps: [4, 6]" in pruned.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # the quick reproduction reports on grids; test_evaluate_then_report_on_a_smoke_run
def test_report_on_a_grid_of_smoke_runs(tmp_path):
    """Three variants on both MLM-vs-CLM axes, every task, then the report: one line per variant in each plot."""
    data_dir = make_data_dir(str(tmp_path / "data"))
    runs = [train(tmp_path / "runs", data_dir, name) for name in GRID]
    sweep = [f"{t}.{o}" for t in ("classification", "token_classification", "qa", "retrieval")
             for o in ("lrs=[1e-3, 1e-4]", "seeds=[0, 1]", "max_steps=2", "batch_size=4")]
    for run_dir in runs:
        results = evaluate(run_dir, data_dir, [*FAST_TASKS, "mntp", "infilling", "clustering", "probing",
                                               "classification", "token_classification", "qa", "retrieval"], *sweep)
        assert {"sc_acc", "tc_f1", "qa_f1", "ir_ndcg10", "probe_ner"} <= set(results["headline"])
    text = report(runs, str(tmp_path / "report"))
    assert "## Should We Still Pretrain" in text and "## MAGNET" in text
    for name in GRID:
        assert f"| {name} |" in text


@pytest.mark.e2e
def test_no_progress_draws_no_bar_not_even_the_libraries(tmp_path):
    """``--no-progress``: no bar at all, transformers' "Loading weights" of from_pretrained included; without it
    that bar is drawn, so the check sees bars."""
    from helpers import tiny_llama

    from pipeline.experiment import SAMPLE_DIR
    from pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    hf_dir = str(tmp_path / "tiny")
    tiny_llama(tok).save_pretrained(hf_dir)
    tok.save(hf_dir)
    args = ["--model", hf_dir, "--tasks", "sts", "--data-dir", os.path.join(REPO, "tests", "fixtures", "eval"),
            "--set", "sts.datasets=[sts/stsb.tsv]", "--out", str(tmp_path / "results.json")]
    quiet, shown = cli("evaluate.py", *args, "--no-progress"), cli("evaluate.py", *args)
    assert quiet.returncode == 0 and shown.returncode == 0, quiet.stderr[-3000:] + shown.stderr[-3000:]
    assert bars(quiet.stderr) == [] and "Loading weights" not in quiet.stderr
    assert any("Loading weights" in line for line in bars(shown.stderr))
