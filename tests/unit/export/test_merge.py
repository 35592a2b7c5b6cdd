"""Merging exports (``launch/merge.py``, pipeline/export/merge.py) through mergekit: the merge of an export with
itself is itself, linear, SLERP and task arithmetic give their formulas on real exports of seeded tiny models, the
result loads and embeds as the inputs do, and inputs that do not merge are refused in one line before any weight is
read."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import tiny_llama
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from pipeline.config import from_dict
from pipeline.eval import encode, load_model
from pipeline.experiment import ExperimentConfig
from pipeline.export.hf import save_hf
from pipeline.export.merge import INSTALL, main
from pipeline.export.record import EncoderRecord, read_record
from pipeline.export.weights import BASE_INDEX
from pipeline.model.load_hf import LM_INDEX

pytest.importorskip("mergekit")

TEXTS = ["The river rises in the hills.", "A much longer sentence about the hills, the river and the sea beyond."]
MNTP = EncoderRecord(attention="bidirectional", reads_previous=True, mask_token="<mask>", objectives=("mntp",))


def save(tokenizer, out: str, record: EncoderRecord, seed: int = 3, lm=None) -> str:
    lm = lm or tiny_llama(tokenizer, seed=seed)
    return save_hf(lm, lm.state_dict(), tokenizer, out, record, from_dict(ExperimentConfig, {}), 0)


@pytest.fixture(scope="module")
def exports(tokenizer, tmp_path_factory) -> dict[str, str]:
    """Two MNTP encoders of other weights, a causal LM (a base), and an encoder with another history."""
    root = tmp_path_factory.mktemp("exports")
    supervised = replace(MNTP, objectives=("mntp", "supervised"), instruction_format="{instruction}: ")
    return {"a": save(tokenizer, str(root / "a"), MNTP, 3), "b": save(tokenizer, str(root / "b"), MNTP, 4),
            "clm": save(tokenizer, str(root / "clm"), EncoderRecord(objectives=("clm",)), 5),
            "supervised": save(tokenizer, str(root / "supervised"), supervised, 4)}


def weights(export: str) -> dict[str, torch.Tensor]:
    """Every weight of an export, an encoder's LM head included."""
    index = os.path.join(export, LM_INDEX)
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index) else [
        "model.safetensors"]
    return {k: v for f in files for k, v in load_file(os.path.join(export, f)).items()}


def merged(out, *args: str) -> str:
    assert main([*args, "--output", str(out), "--no-progress"]) == 0
    return str(out)


def record(export: str) -> EncoderRecord:
    with open(os.path.join(export, "config.json")) as f:
        return read_record(json.load(f))


def test_an_export_merged_with_itself_is_itself_and_embeds_as_it(exports, tmp_path):
    a = exports["a"]
    out = merged(tmp_path / "self", "--method", "linear", "--models", a, a)
    ours, theirs = weights(out), weights(a)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert {f for f in os.listdir(out) if "safetensors" in f} == {f for f in os.listdir(a) if "safetensors" in f}
    assert record(out) == record(a) == MNTP
    model = load_model(out)
    assert model.attention == "bidirectional" and model.record == MNTP
    assert np.array_equal(encode(model, TEXTS), encode(load_model(a), TEXTS))  # the same pooled path
    card = open(os.path.join(out, "README.md")).read()
    assert "mergekit's `linear`" in card and "| `a` | 1 | mntp |" in card and "mergekit" in card.split("---")[1]
    assert "model: a" in open(os.path.join(out, "mergekit_config.yml")).read()  # by name, not the staging path


def test_linear_half_merge_is_the_mean_and_loads_as_an_encoder(exports, tmp_path):
    out = merged(tmp_path / "mean", "--method", "linear", "--models", exports["a"], exports["b"],
                 "--weights", "0.5", "0.5")
    a, b, ours = weights(exports["a"]), weights(exports["b"]), weights(out)
    assert ours.keys() == a.keys() and all(torch.equal(ours[k], (a[k] + b[k]) / 2) for k in a)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])  # the head too, from its own file
    assert record(out) == MNTP
    model = load_model(out)
    assert model.attention == "bidirectional"
    assert encode(model, TEXTS).shape == (2, model.lm.config.hidden_size)


def test_slerp_at_its_ends_gives_each_export(exports, tmp_path):
    pair = ["--method", "slerp", "--models", exports["a"], exports["b"]]
    for t, end in (("0", "a"), ("1", "b")):
        ours, theirs = weights(merged(tmp_path / t, *pair, "--t", t)), weights(exports[end])
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), end


def test_task_arithmetic_adds_the_weighted_task_vectors_to_the_base(exports, tmp_path, capsys):
    """The base is a causal LM (no encoder's record is asked of it); the second export's history differs, so the
    merge keeps the first's and says so."""
    out = merged(tmp_path / "ta", "--method", "task_arithmetic", "--base", exports["clm"],
                 "--models", exports["a"], exports["supervised"], "--weights", "0.5", "0.25", "--lambda", "2")
    (base, a, s), ours = (weights(exports[k]) for k in ("clm", "a", "supervised")), weights(out)
    for k in base:
        torch.testing.assert_close(ours[k], base[k] + 2 * (0.5 * (a[k] - base[k]) + 0.25 * (s[k] - base[k])),
                                   rtol=0, atol=1e-6)
    assert record(out) == MNTP  # the first export's
    assert "the inputs' records differ in instruction_format, objectives: kept the first's" in capsys.readouterr().out
    assert "(base)" in open(os.path.join(out, "README.md")).read()


@pytest.mark.parametrize("other, args, message", [
    ("clm", (), "error: {other} and {a} differ in decoder_encoders.attention ('causal' vs 'bidirectional'): merge "
                "exports of one architecture that read text one way"),
    ("last", (), "error: {other} and {a} differ in decoder_encoders.pooling ('last' vs 'mean'): merge exports of one "
                 "architecture that read text one way"),
    ("narrow", (), "error: {other} and {a} differ in intermediate_size (96 vs 128): merge exports of one "
                   "architecture that read text one way"),
    ("narrow", ("--method", "task_arithmetic", "--base"), "error: {other} and {a} differ in intermediate_size (96 vs "
                                                          "128): merge exports of one architecture (the base too)"),
    ("plain", (), "error: {other}: config.json has no decoder_encoders record, so how it reads text is unknown; merge "
                  "exports of launch/export_hf.py (a plain checkpoint may be task arithmetic's --base)"),
])
def test_inputs_that_do_not_merge_are_refused_in_one_line_before_any_weight_is_read(
        tokenizer, exports, tmp_path, capsys, other, args, message):
    """The refused exports' weight files are empty: reading one would fail otherwise."""
    narrow = copy.deepcopy(tiny_llama(tokenizer).config)
    narrow.intermediate_size = 96
    made = {"last": lambda out: save(tokenizer, out, replace(MNTP, pooling="last")),
            "narrow": lambda out: save(tokenizer, out, MNTP, lm=LlamaForCausalLM(narrow)),
            "plain": lambda out: tiny_llama(tokenizer).save_pretrained(out) or out}
    paths = {}
    for name in ("a", other):
        source = made[other](str(tmp_path / "made")) if name == other and other in made else exports[name]
        paths[name] = str(tmp_path / name)
        os.makedirs(paths[name])
        shutil.copy(os.path.join(source, "config.json"), paths[name])
        open(os.path.join(paths[name], "model.safetensors"), "w").close()
    models = [paths["a"], paths["a"]] if args else [paths["a"], paths[other]]
    cli = [*(args + (paths[other],) if args else ("--method", "linear")), "--models", *models]
    capsys.readouterr()  # the exports' own output
    assert main([*cli, "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [message.format(other=paths[other], a=paths["a"])]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("args, message", [
    (("--method", "slerp", "--models", "A", "A", "A"), "--models: slerp merges exactly 2 export(s); 3 given"),
    (("--method", "slerp", "--models", "A", "A", "--t", "1.5"), "--t 1.5: SLERP interpolates between its exports; "
                                                              "pass 0 (the first) to 1 (the second)"),
    (("--method", "linear", "--models", "A", "A", "--weights", "1"), "--weights: 1 weight(s) for 2 export(s); give "
                                                                     "one per export, in the order of --models"),
    (("--method", "task_arithmetic", "--models", "A"), "--base: task arithmetic adds each export's difference from "
                                                       "a base to it; name the base (e.g. the checkpoint the exports "
                                                       "were trained from)"),
    (("--method", "linear", "--models", "A", "A", "--output", "A"), "--output {a}: one of the inputs; name a new "
                                                                    "directory"),
    (("--method", "linear", "--models", "A", "A", "--output", "KEPT"), "--output {kept}: a directory that holds no "
     "export; a merge replaces its directory as a whole: name a new directory or remove this one"),
    (("--method", "linear", "--models", "A", "A", "--t", "0.3"), "--t applies to --method slerp, not linear"),
    (("--method", "slerp", "--models", "A", "A", "--weights", "1", "1"), "--weights: SLERP weighs its two exports by "
                                                                         "--t (0: the first, 1: the second)"),
    (("--method", "linear", "--models", "A", "A", "--weights", "nan", "1"), "--weights, --t and --lambda must be "
                                                                           "finite numbers"),
    (("--method", "linear", "--models", "A", "A", "--weights", "1", "-1"), "--weights [1.0, -1.0]: linear merging "
                                                                           "divides by their sum, which is 0"),
])
def test_settings_that_do_not_fit_the_method_are_refused_in_one_line(exports, tmp_path, capsys, args, message):
    kept = tmp_path / "kept"  # a directory of something else, which a merge would replace
    kept.mkdir()
    (kept / "notes.txt").write_text("not an export")
    args = [{"A": exports["a"], "KEPT": str(kept)}.get(a, a) for a in args]
    assert main(args + ([] if "--output" in args else ["--output", str(tmp_path / "out")])) == 2
    assert capsys.readouterr().err.splitlines() == ["error: " + message.format(a=exports["a"], kept=kept)]
    assert (kept / "notes.txt").read_text() == "not an export"


def test_a_directory_that_is_not_an_export_is_refused_in_one_line(exports, tmp_path, capsys):
    empty, weightless = tmp_path / "empty", tmp_path / "weightless"
    empty.mkdir()
    weightless.mkdir()
    shutil.copy(os.path.join(exports["a"], "config.json"), weightless)
    for path, said in ((empty, "no config.json; pass export directories (launch/export_hf.py --output DIR)"),
                       (weightless, f"no model.safetensors (or {BASE_INDEX}); mergekit merges safetensors exports")):
        assert main(["--method", "linear", "--models", exports["a"], str(path), "--output", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {path}: {said}"]
    assert not os.path.exists(tmp_path / "o")


def test_a_missing_mergekit_is_one_line_naming_the_extra(exports, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "mergekit" or m.startswith("mergekit.")] or ["mergekit"]:
        monkeypatch.setitem(sys.modules, name, None)  # import mergekit... raises ImportError, as where not installed
    assert main(["--method", "linear", "--models", exports["a"], exports["b"], "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: merging needs mergekit: {INSTALL}"]
