"""Study 4 of docs/results.md (pipeline/reproduce/recipes.py, experiments/reproduce/recipes/grid.yaml): the grid's
runs and their wiring to the driver, the Matryoshka claim's verdict, the false-negative count of mined rows."""

from __future__ import annotations

import json
import os

from pipeline.config import to_dict
from pipeline.grid import load_grid
from pipeline.io import REPO
from pipeline.reproduce import recipes
from pipeline.reproduce.recipes import (
    DIMS,
    GRID,
    MINED_SHARDS,
    NAME,
    OUT,
    WIDTH,
    answers,
    false_negatives,
    matryoshka_claims,
)
from pipeline.reproduce.results import Measured


def _variants(grid: str) -> dict:
    return {v.name: v for v in load_grid(os.path.join(REPO, grid)).variants(out=OUT)}


def test_the_grid_reuses_study_1s_mntp_run_and_each_arm_differs_from_its_twin_in_one_setting():
    ours, study1 = _variants(GRID), _variants("experiments/reproduce/llm2vec/grid.yaml")
    # the same resolved experiment: the sweep finds study 1's run finished and trains it only where it is missing
    assert to_dict(ours["llm2vec-mntp"].experiment) == to_dict(study1["llm2vec-mntp"].experiment)
    assert sorted(ours) == sorted(["llm2vec-mntp"] + [f"{NAME}-{kind}-s{seed}" for seed in range(3) for kind in
                                                      ("simcse", "simcse-mrl", "supervised-given",
                                                       "supervised-mined")])
    for seed in range(3):
        runs = {kind: to_dict(ours[f"{NAME}-{kind}-s{seed}"].experiment) for kind in
                ("simcse", "simcse-mrl", "supervised-given", "supervised-mined")}
        for kind, run in runs.items():
            assert (run.pop("name"), run.pop("run_dir")) == (f"{NAME}-{kind}-s{seed}", f"{OUT}/{NAME}-{kind}-s{seed}")
        assert runs["simcse"]["train"]["seed"] == seed
        assert runs["simcse"]["model"]["init"] == os.path.join(OUT, "llm2vec-mntp", "hf")
        mrl = runs["simcse-mrl"]["phases"][0]["objectives"][0]["matryoshka"]
        assert mrl["dims"] == sorted(DIMS, reverse=True) and mrl["dims"][0] == WIDTH  # what the driver reads at
        runs["simcse-mrl"]["phases"][0]["objectives"][0]["matryoshka"] = None
        assert runs["simcse-mrl"] == runs["simcse"]
        mined = runs["supervised-mined"]["data"]
        assert mined["pair_shards"] == mined["shards"] == MINED_SHARDS  # what the driver's mining builds
        runs["supervised-mined"]["data"] = runs["supervised-given"]["data"]
        assert runs["supervised-mined"] == runs["supervised-given"]


def test_the_matryoshka_claim_needs_both_parts():
    claims = dict(matryoshka_claims(Measured((0.5, 0.8, 1.0)), Measured((6.0, 8.0, 9.0))))
    assert [v for v, _ in claims.values()] == ["reproduced"] * 3
    # a drop of ~2 points with Matryoshka leaves its first part inside the spread, and so the claim
    claims = matryoshka_claims(Measured((1.5, 2.0, 2.4)), Measured((6.0, 8.0, 9.0)))
    assert [v for _, (v, _) in claims] == ["inconclusive", "inconclusive", "reproduced"]
    # Matryoshka dropping more than plain SimCSE refutes the claim whatever the first part says
    claims = matryoshka_claims(Measured((0.5, 0.6, 0.7)), Measured((0.0, 0.1, 0.2)))
    assert [v for _, (v, _) in claims] == ["not reproduced", "reproduced", "not reproduced"]
    assert matryoshka_claims(None, None)[0][1][0] == "inconclusive"


def test_a_mined_negative_that_the_pair_rules_pair_with_its_query_is_a_false_negative(tmp_path):
    scene = "\n\n".join(f"{who}.\n{text}" for who, text in (
        ("ANNA", "Where have you been all night, my friend? Tell me."),
        ("BEN", "At the tavern by the river, as you well know. Ask them."),
        ("ANNA", "I asked them already and they said you had left. Speak."),
        ("BEN", "Then they lied to you, my lady, every one of them. Truly.")))
    rules = answers([scene])
    assert rules["replies"]["Where have you been all night, my friend? Tell me."] == {
        "At the tavern by the river, as you well know. Ask them."}
    given, mined = tmp_path / "given", tmp_path / "mined"
    given.mkdir()
    mined.mkdir()
    rows = [{"query": "q1", "positive": "p1", "negative": "n1"}, {"query": "q2", "positive": "p2", "negative": "n2"}]
    (given / "replies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # q1 mined p3, which the rules also pair with q1; q2 mined its given negative
    (mined / "replies.jsonl").write_text(json.dumps({**rows[0], "negative": ["p3"]}) + "\n"
                                         + json.dumps({**rows[1], "negative": ["n2"]}) + "\n")
    skipped = {"absolute_margin": 0, "relative_margin": 4, "max_score": 0, "min_score": 0}
    (mined / "mining.json").write_text(json.dumps({"files": {"replies.jsonl": {"rows": 3, "kept": 2,
                                                                               "skipped": skipped}}}))
    counts = false_negatives(str(mined), {"replies": {"q1": {"p1", "p3"}, "q2": {"p2"}}}, str(given))
    assert counts == {"replies": {"rows": 3, "kept": 2, "negatives": 2, "false": 1, "given": 1, "skipped": skipped}}


def test_every_evaluation_reads_a_run_or_merge_of_the_grid_and_each_width_has_its_file():
    names = set(_variants(GRID)) | {os.path.basename(m) for m in recipes.merges()}
    found = recipes.evaluations()
    assert {os.path.basename(model) for model, *_ in found} <= names
    files = {recipes.results_file(model, dim) for model, dim, *_ in found}
    simcse = os.path.join(OUT, f"{NAME}-simcse-mrl-s1")
    assert {recipes.results_file(simcse, d) for d in DIMS} <= files
    assert len({recipes.results_file(simcse, d) for d in DIMS}) == len(DIMS)


def test_the_page_has_the_study_block_and_a_study_with_nothing_run_says_so(tmp_path, monkeypatch):
    page = tmp_path / "results.md"
    page.write_text(open(os.path.join(REPO, "docs", "results.md")).read())
    monkeypatch.chdir(tmp_path)  # nothing run here, whatever this checkout's runs/reproduce holds
    record = {"rules": {"replies": {"queries": 10, "with_several_answers": 1}}}
    recipes.write_block(str(page), recipes.markdown(record, {}))
    block = page.read_text().split(f"<!-- BEGIN full {NAME} -->")[1].split(f"<!-- END full {NAME} -->")[0]
    claims = [line for line in block.splitlines() if line.startswith("| ") and "| **" in line]
    assert len(claims) == 3 + 4 + 4  # (a) the claim and its two parts, (b) three retrieval claims and the rate, (c)
    assert all("| **inconclusive** |" in line for line in claims)
    assert "1 of 10 replies queries have more than one answer" in block


def test_the_committed_mining_records_name_paths_relative_to_the_checkout():
    """The records are kept in the repository: a path in them names the file in any checkout."""
    def paths(value):
        if isinstance(value, dict):
            return [p for k, v in value.items() for p in ([v] if k == "path" else paths(v))]
        return [p for v in value for p in paths(v)] if isinstance(value, list) else []

    for variant in recipes.FILTERS:
        with open(os.path.join(REPO, "docs", "results", "full", NAME, "mining", f"{variant}.json")) as f:
            found = paths(json.load(f)) + [json.load(open(f.name))["model"]]
        assert found and not any(os.path.isabs(p) for p in found), found
