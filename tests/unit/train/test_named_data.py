"""A run trains on the data it names (issue 51): a shard directory built from other inputs, or from files changed
since, is refused naming both and the fixes (or rebuilt beside itself with data.rebuild=true); a named input that
matches no file is refused whatever the directory holds. Each refusal is one line and exit 2, with ``--check`` and
without, before any shard or model is built. In process, on shards the real builder made from real files."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import TOKENIZER
from helpers import REPO, in_process_entry

from pipeline.config import ConfigError
from pipeline.data.format.index import load_index
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import load_experiment
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


def test_data_rebuild_builds_the_inputs_named_beside_the_old_shards_and_swaps_them_in(build_shards, inputs,
                                                                                      tmp_path, capsys):
    """The rebuilt directory is the one a fresh build of b.jsonl makes (determinism), and nothing else is left."""
    a, b = inputs
    shards = tmp_path / "shards"
    shutil.copytree(build_shards(inputs=(a,)), shards)
    exp = load_experiment(None, [*BASE, f"run_dir={tmp_path / 'run'}", f"data.shards={shards}",
                                 f"data.build_inputs=[{b}]", "data.rebuild=true"])
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
