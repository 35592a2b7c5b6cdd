"""A run trains on the data it names and resumes only what it can (issue 51): a shard directory built from other
inputs, or from files changed since, is refused naming both and the fixes (or rebuilt beside itself with
data.rebuild=true); a named input that matches no file is refused whatever the directory holds; a run directory
whose checkpoint this run could not resume (other shards, model shape, objectives) is refused naming it, the
difference and ``--set name=NEW``. Each refusal is one line and exit 2, with ``--check`` and without, before any
shard or model is built. In process, on shards the real builder made from real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import TOKENIZER
from helpers import REPO, in_process_entry

from pipeline.config import ConfigError, to_dict
from pipeline.data.format.index import load_index, load_manifest
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.data.prep.manifest import built_otherwise
from pipeline.experiment import load_experiment
from pipeline.io import write_json_atomic
from pipeline.model.build import preset_config
from pipeline.run_dir import MARKER, DataRecord, RunDir
from pipeline.tokenizer import load_tokenizer
from pipeline.train.preflight import preflight

BASE = ["data.seq_len=64", "train.steps=10"]
ZERO3 = os.path.join(REPO, "ds_configs", "zero3.json")  # the default --config, from any working directory


def corpus(path, word: str) -> str:
    """200 records of their own words (~60 samples of 64 tokens)."""
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{word} {i}: the {word} of harbour {i % 13} holds {i * 3} crates."}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[str, str]:
    """(a.jsonl, b.jsonl): two corpora, read only."""
    root = tmp_path_factory.mktemp("inputs")
    return corpus(root / "a.jsonl", "ledger"), corpus(root / "b.jsonl", "manifest")


def snapshot(*roots) -> dict[str, float]:
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for root in roots
            for d, _, files in os.walk(root) for f in files}


def start(capsys, overrides: list[str], check: bool) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``launch/train.py`` in process with ``overrides``: ``--check``, or a run's
    start (one rank, no launcher), which a refusal ends before its process group."""
    with in_process_entry() as main:
        rc = main(["--config", ZERO3, *(["--check"] if check else []),
                   *[a for o in [*BASE, *overrides] for a in ("--set", o)]])
    out, err = capsys.readouterr()
    return rc, out, err


def refusal(capsys, overrides: list[str], check: bool) -> str:
    """The one ``config error`` line of a start refused with exit 2."""
    rc, _, err = start(capsys, overrides, check)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: "), err
    return lines[0]


@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_shards_built_from_other_inputs_are_refused_naming_both_and_the_fixes(build_shards, inputs, tmp_path,
                                                                              capsys, check):
    """It trained on the shards of a.jsonl, recording b.jsonl in its experiment and model card, and --check
    passed."""
    a, b = inputs
    shards = build_shards(inputs=(a,))
    run = tmp_path / "run"
    before, _ = snapshot(shards), capsys.readouterr()  # the build's report (the first test to read them builds)
    line = refusal(capsys, [f"run_dir={run}", f"data.shards={shards}", f"data.build_inputs=[{b}]"], check)
    assert line == (f"config error: data.shards: {shards} was built from [{a}], not [{b}]: it does not hold the "
                    f"shards of data.build_inputs; build them into a new directory (another data.shards), or set "
                    f"data.rebuild=true to rebuild {shards} (beside it, swapped in when complete)")
    assert snapshot(shards) == before and not run.exists()
    rc, out, err = start(capsys, [f"run_dir={run}", f"data.shards={shards}", f"data.build_inputs=[{a}]"], True)
    assert rc == 0 and f"shards {shards} (packed): " in out, err  # the inputs it was built from pass


def test_a_phases_own_shards_are_held_to_the_inputs_named_too(build_shards, inputs, tmp_path, capsys):
    """Context extension: the phase's directory at its sequence length, built from data.build_inputs as
    data.shards is."""
    a, b = inputs
    shards, longer = build_shards(inputs=(b,)), build_shards(inputs=(a,), seq_len=128)
    capsys.readouterr()
    phases = f"phases=[{{share: 0.5, objectives: [{{name: clm}}]}}, {{share: 0.5, seq_len: 128, shards: {longer}, " \
             f"objectives: [{{name: clm}}]}}]"
    line = refusal(capsys, [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}", f"data.build_inputs=[{b}]",
                            phases], True)
    assert line.startswith(f"config error: phases[1].shards: {longer} was built from [{a}], not [{b}]: it does not "
                           f"hold the shards of data.build_inputs (for phases[1]); build them into a new directory "
                           f"(another phases[1].shards), or set data.rebuild=true"), line


def test_unit_shards_named_as_data_shards_are_not_held_to_the_packed_inputs(build_shards, inputs, tmp_path, capsys):
    """A units (or pairs) stage names its shards as data.shards beside the packed inputs its experiment inherits
    (experiments/reproduce/llm2vec): a run never builds such a directory from them, so it is read as built."""
    units, _ = build_shards(inputs=(inputs[1],), units="sentence"), capsys.readouterr()
    rc, out, err = start(capsys, [f"run_dir={tmp_path / 'run'}", f"data.shards={units}", f"data.unit_shards={units}",
                                  f"data.build_inputs=[{inputs[0]}]", "data.build_if_missing=false",
                                  "model.attention_dropout=0.3", "phases=[{objectives: [{name: simcse}]}]"], True)
    assert rc == 0 and f"shards {units} (units): " in out, err


def test_an_input_changed_since_the_build_is_refused(tmp_path, capsys):
    a = corpus(tmp_path / "a.jsonl", "ledger")
    shards = tmp_path / "shards"
    run_job(BuildConfig(inputs=(a,), tokenizer=TOKENIZER, output=str(shards), seq_len=64, progress=False))
    overrides = [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}", f"data.build_inputs=[{a}]"]
    assert start(capsys, overrides, True)[0] == 0
    stat = os.stat(a)
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the same size: a rewrite in place
    assert refusal(capsys, overrides, True).startswith(
        f"config error: data.shards: {shards} was built from [{a}] before it changed (size or modification time): "
        f"it does not hold the shards of data.build_inputs; ")


def test_an_input_named_through_a_linked_directory_is_the_input_built_from(tmp_path, capsys):
    """The same file reached through a link (a checkout whose runs/ links elsewhere, a cluster's /home on /gpfs) is
    the input the shards were built from: they were refused as another input's."""
    (tmp_path / "data").mkdir()
    a = corpus(tmp_path / "data" / "a.jsonl", "ledger")
    shards = tmp_path / "shards"
    run_job(BuildConfig(inputs=(a,), tokenizer=TOKENIZER, output=str(shards), seq_len=64, progress=False))
    os.symlink(tmp_path / "data", tmp_path / "linked")
    linked = str(tmp_path / "linked" / "a.jsonl")
    rc, out, err = start(capsys, [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}",
                                  f"data.build_inputs=[{linked}]"], True)
    assert rc == 0 and f"shards {shards} (packed): " in out, err


def test_data_rebuild_builds_the_inputs_named_beside_the_old_shards_and_swaps_them_in(build_shards, inputs,
                                                                                      tmp_path, capsys):
    """The rebuilt directory is the one a fresh build of b.jsonl makes (determinism), and nothing else is left."""
    a, b = inputs
    shards = tmp_path / "shards"
    shutil.copytree(build_shards(inputs=(a,)), shards)
    overrides = [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}", f"data.build_inputs=[{b}]",
                 "data.rebuild=true"]
    before, _ = snapshot(shards), capsys.readouterr()
    rc, out, err = start(capsys, overrides, True)
    assert rc == 0 and f"shards {shards}: built from other inputs; rank 0 rebuilds them (data.rebuild) from 1 input " \
                       f"file(s) when the run starts (--check builds nothing)" in out, err
    assert snapshot(shards) == before
    exp = load_experiment(None, [*BASE, *overrides])
    with preflight(exp, 0, 1) as prepared:
        rebuilt = prepared.indexes["packed"]
    assert f"rebuilding shards of ['{b}'] into {shards} (seq_len 64, data.rebuild: built from other inputs)" in \
        capsys.readouterr().out
    fresh = load_index(build_shards(inputs=(b,)))
    assert rebuilt.fingerprint == fresh.fingerprint != load_index(build_shards(inputs=(a,))).fingerprint
    assert [s.sha256 for s in rebuilt.shards] == [s.sha256 for s in fresh.shards]
    assert [n for n in os.listdir(tmp_path) if n.startswith("shards.")] == []  # no half-built or replaced one
    with preflight(exp, 0, 1) as again:  # built from the inputs named now: read as it is
        assert again.indexes["packed"].fingerprint == fresh.fingerprint
    assert "rebuilding" not in capsys.readouterr().out


def test_every_setting_a_run_builds_with_is_compared(build_shards, inputs, tokenizer):
    """Besides the inputs: the tokenizer, the sequence length and the source settings, each named with both
    values (the trainer's check_compatible would name the tokenizer without the data.rebuild fix)."""
    shards = build_shards(inputs=(inputs[0],))
    manifest = load_manifest(shards)
    assert built_otherwise(manifest, [inputs[0]], tokenizer.info.fingerprint, 64, ("", "")) == []
    assert built_otherwise(manifest, [inputs[0]], "another", 128, ("meta.source", "")) == [
        f"with another tokenizer ({TOKENIZER} {tokenizer.info.fingerprint!r}, data.tokenizer has 'another')",
        "at seq_len 64, not 128",
        "with sources from field/default ('', ''), not data.build_source_field/default ('meta.source', '')"]


def test_data_rebuild_needs_inputs_to_rebuild_from():
    with pytest.raises(ConfigError, match=r"^data.rebuild: true, but data.build_inputs names nothing to rebuild "
                                          r"/data/mine from; set data.build_inputs=\[FILES\]"):
        load_experiment(None, ["data.shards=/data/mine", "data.rebuild=true"])


@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_named_inputs_that_match_no_file_are_refused_whatever_the_directory_holds(build_shards, inputs, tmp_path,
                                                                                  capsys, check):
    """It trained (exit 0) on whatever the directory held."""
    shards, missing = build_shards(inputs=(inputs[0],)), tmp_path / "no-such-input.jsonl"
    capsys.readouterr()
    line = refusal(capsys, [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}",
                            f"data.build_inputs=[{missing}]"], check)
    assert line == (f"config error: data.build_inputs: '{missing}' matches no file; check the path or quote the "
                    f"glob, or set data.build_inputs=[] to read {shards} as built")
    assert not (tmp_path / "run").exists()


def taken_run(build_shards, inputs, *overrides: str) -> str:
    """``runs/sample-tiny-clm`` (under the working directory) as a run trained on the shards of a.jsonl left it: a
    complete checkpoint of step 5 with the run files the trainer writes (``overrides``: its experiment's)."""
    shards = build_shards(inputs=(inputs[0],))
    exp = load_experiment(None, [*BASE, f"data.shards={shards}", f"data.build_inputs=[{inputs[0]}]", *overrides])
    index, tok = load_index(shards), load_tokenizer(TOKENIZER)
    model = preset_config(exp.model.init, tok.info.vocab_size, pad_token_id=tok.info.pad_id,
                          bos_token_id=tok.info.bos_id, eos_token_id=tok.info.eos_id).to_dict()
    run = RunDir(exp.run_dir)
    step = run.checkpoint(5)
    os.makedirs(step)
    files = run.run_files(to_dict(exp), {}, model, DataRecord(index.directory, index.fingerprint,
                                                              index.num_samples, index.num_tokens))
    for name, content in {**files, MARKER: {"world_size": 1}}.items():
        write_json_atomic(os.path.join(step, name), content)
    return shards


@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_a_taken_run_name_is_refused_before_anything_is_built(build_shards, inputs, tmp_path, monkeypatch, capsys,
                                                              check):
    """The README's own-data command after the demo: it built the shards and the model, then exited 1 on the loader
    state's fingerprint, naming neither the run directory nor a new name, and --check passed it. The fingerprint
    this run's shards, still to build from b.jsonl, cannot have the checkpoint's: their settings name another
    input, which is told before the tokenizer loads (test_these_refusals_come_before_torch_transformers_and_deepspeed)."""
    monkeypatch.chdir(tmp_path)
    shards = taken_run(build_shards, inputs)
    b = inputs[1]
    trained = load_index(shards).fingerprint
    before, _ = snapshot(tmp_path, shards), capsys.readouterr()
    new = load_experiment(None, [*BASE, f"data.build_inputs=[{b}]"]).data.shards
    line = refusal(capsys, [f"data.build_inputs=[{b}]"], check)
    assert line == (f"config error: name: runs/sample-tiny-clm holds run sample-tiny-clm's checkpoint of step 5, "
                    f"trained on {shards} (fingerprint {trained[:12]}), while this run's data.shards {new} (from "
                    f"data.build_inputs ['{b}']) are to be built from other inputs or data.seq_len, which this run "
                    f"cannot resume; start a new run with --set name=NEW, or resume with that run's settings")
    assert snapshot(tmp_path, shards) == before and not os.path.exists(new)
    rc, out, err = start(capsys, [f"data.build_inputs=[{b}]", "name=mine"], True)  # the fix the line gives
    assert rc == 0 and "resume: no complete checkpoint in runs/mine/checkpoints" in out, err


@pytest.mark.parametrize("change,difference", [
    ("model.init=20m", "with a model of hidden_size 64, intermediate_size 128, num_hidden_layers 2, "
                       "num_attention_heads 4, num_key_value_heads 2, head_dim 16, while this run's (20m) has "
                       "hidden_size 384, intermediate_size 1536, num_hidden_layers 6, num_attention_heads 6, "
                       "num_key_value_heads 6, head_dim 64"),
    ("phases=[{objectives: [{name: mlm}]}]", "with the objectives [['clm']], while this run has [['mlm']]"),
], ids=["model shape", "objectives"])
def test_a_run_directory_of_another_model_or_objectives_is_refused(build_shards, inputs, tmp_path, monkeypatch,
                                                                   capsys, change, difference):
    """The run's own settings resume it, also from the same inputs built into another directory (the same
    fingerprint); another model shape or objectives are refused."""
    monkeypatch.chdir(tmp_path)
    shards = taken_run(build_shards, inputs)
    same, _ = [f"data.shards={shards}", f"data.build_inputs=[{inputs[0]}]"], capsys.readouterr()
    for where in (shards, tmp_path / "elsewhere"):
        rc, out, err = start(capsys, [f"data.shards={where}", f"data.build_inputs=[{inputs[0]}]"], True)
        assert rc == 0 and "resume: from step 5 (runs/sample-tiny-clm/checkpoints/step00000005)" in out, err
    line = refusal(capsys, [*same, change], True)
    assert line == (f"config error: name: runs/sample-tiny-clm holds run sample-tiny-clm's checkpoint of step 5, "
                    f"trained {difference}, which this run cannot resume; start a new run with --set name=NEW, or "
                    f"resume with that run's settings")


def test_a_phases_own_shards_changed_under_a_resume_are_refused(build_shards, inputs, tmp_path, monkeypatch, capsys):
    """A context extension's phase reads shards of its own. Resumed on other shards there, the run passed --check
    and failed only on the loader state's fingerprint once the model was built, naming neither the field nor the fix;
    the checkpoint's data.json now records each phase's shards (what the trainer writes: Prepared.data_record), and
    preflight refuses as it does for data.shards."""
    monkeypatch.chdir(tmp_path)
    a, b = inputs
    shards, trained, other = (build_shards(inputs=(x,), seq_len=n) for x, n in ((a, 64), (a, 128), (b, 128)))

    def settings(longer: str) -> list[str]:  # prebuilt shards, no inputs named: the fingerprints alone differ
        return [f"data.shards={shards}", "data.build_inputs=[]", "phases=[{share: 0.5, objectives: [{name: clm}]}, "
                f"{{share: 0.5, seq_len: 128, shards: {longer}, objectives: [{{name: clm}}]}}]"]

    exp = load_experiment(None, [*BASE, *settings(trained)])
    with preflight(exp, 0, 1) as prepared:
        record = prepared.data_record()
    fingerprints = [load_index(x).fingerprint for x in (trained, other)]
    assert record.phase_shards == {"phases[1]": {"directory": trained, "fingerprint": fingerprints[0]}}
    step = RunDir(exp.run_dir).checkpoint(5)
    os.makedirs(step)
    files = RunDir(exp.run_dir).run_files(to_dict(exp), {}, {}, record)
    for name, content in {**files, MARKER: {"world_size": 1}}.items():
        write_json_atomic(os.path.join(step, name), content)
    rc, out, err = start(capsys, settings(trained), True)
    assert rc == 0 and "resume: from step 5 (runs/sample-tiny-clm/checkpoints/step00000005)" in out, err
    for check in (True, False):
        assert refusal(capsys, settings(other), check) == (
            f"config error: name: runs/sample-tiny-clm holds run sample-tiny-clm's checkpoint of step 5, trained with "
            f"phases[1].shards {trained} (fingerprint {fingerprints[0][:12]}), while this run's phases[1].shards "
            f"{other} has {fingerprints[1][:12]}, which this run cannot resume; start a new run with --set name=NEW, "
            f"or resume with that run's settings")


def test_these_refusals_come_before_torch_transformers_and_deepspeed(build_shards, inputs, tmp_path, monkeypatch):
    """A refusal of the run's inputs is as quick as a config error's: a named input that matches nothing, shards
    built from other inputs and a taken run name (its shards built, or still to build from other inputs: the
    README's own-data command after the demo), with --check and without, and a resume's other
    global batch (--check's ranks are the GPUs torch finds), in one fresh process that imports none of torch,
    transformers and DeepSpeed (each took 7-9 s a start: preflight imported all three first)."""
    monkeypatch.chdir(tmp_path)  # the taken run's runs/sample-tiny-clm, and the subprocess's working directory
    a, b = inputs
    shards = taken_run(build_shards, inputs)
    checks = [["--check"], []]
    starts = [("matches no file", [f"data.shards={shards}", f"data.build_inputs=[{tmp_path / 'no-such.jsonl'}]"],
               checks),
              ("was built from", [f"data.shards={shards}", f"data.build_inputs=[{b}]", "name=other"], checks),
              ("are to be built from other inputs", [f"data.shards={tmp_path / 'to-build'}",  # (first: it is
                                                     f"data.build_inputs=[{b}]"], checks),  # a taken name's line too)
              ("holds run sample-tiny-clm's checkpoint", [f"data.shards={build_shards(inputs=(b,))}",
                                                          f"data.build_inputs=[{b}]"], checks),
              ("global batch of", [f"data.shards={shards}", f"data.build_inputs=[{a}]", "train.grad_accum=2"], [[]])]
    argvs = [["--config", ZERO3, *check, *[x for o in [*BASE, *overrides] for x in ("--set", o)]]
             for _, overrides, each in starts for check in each]
    code = f"""if True:
        import sys
        from pipeline.train.entry import main
        print([main(argv) for argv in {argvs!r}])
        print(sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "transformers", "deepspeed"}}))
    """
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu"})
    assert run.stdout.splitlines() == [str([2] * len(argvs)), "[]"], (run.stdout, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.startswith("config error: ")]
    assert [next(k for k, _, _ in starts if k in line) for line in lines] == [k for k, _, each in starts
                                                                            for _ in each], lines
