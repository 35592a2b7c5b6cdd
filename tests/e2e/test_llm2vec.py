"""The LLM2Vec recipe: its experiment files carry LLM2Vec's settings, the CPU smoke twins run MNTP and then SimCSE
from MNTP's HF export on 2 ZeRO-3 ranks, and bad input through the trainer is refused with a clear message."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import REPO, launch_training, logged_steps, plain_transformers_hidden
from shard_corpus import HOLDOUT, TOKENIZER, documents, write_jsonl_zst
from transformers import AutoConfig

from pipeline.config import to_dict
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.eval import encode, load_model
from pipeline.eval.forward import hidden_states, pad_id, pad_rows
from pipeline.experiment import load_experiment
from pipeline.export.record import EncoderRecord, read_record
from pipeline.objectives import SimCSE, make_objective
from pipeline.tokenizer import load_tokenizer
from pipeline.train.preflight import check_model, preflight

EXPERIMENTS = os.path.join(REPO, "experiments", "llm2vec")
GPUS = 8  # the full experiments' batch sizes are per GPU for 8 GPUs


def experiment(name: str, *overrides: str):
    return load_experiment(os.path.join(EXPERIMENTS, name), list(overrides))


def test_experiment_files_carry_llm2vec_settings():
    assert sorted(os.listdir(EXPERIMENTS)) == ["mntp-lora.yaml", "mntp-smoke.yaml", "mntp.yaml", "simcse-lora.yaml",
                                               "simcse-smoke.yaml", "simcse.yaml", "supervised-lora.yaml",
                                               "supervised-smoke.yaml", "supervised.yaml"]
    mntp, simcse = experiment("mntp.yaml"), experiment("simcse.yaml")
    (spec,) = mntp.phases[0].objectives
    assert (spec.name, spec.ratio, spec.policy, spec.mask_token) == ("mntp", 0.2, "80-10-10", "_")
    assert (mntp.train.steps, mntp.train.micro_batch * mntp.train.grad_accum * GPUS, mntp.data.seq_len) == (1000, 32, 512)
    assert (mntp.optim.lr, mntp.optim.schedule, mntp.optim.weight_decay) == (5e-5, "constant", 0.0)
    assert not mntp.phases[0].document_masking
    (spec,) = simcse.phases[0].objectives
    assert (spec.name, spec.scale) == ("simcse", 20.0) and simcse.model.attention_dropout == 0.3
    assert (simcse.train.steps, simcse.data.unit_micro_batch * simcse.train.grad_accum * GPUS) == (1000, 128)
    assert (simcse.data.seq_len, simcse.optim.lr, simcse.optim.schedule) == (128, 3e-5, "constant")
    assert simcse.model.init == os.path.join(mntp.run_dir, "hf")  # SimCSE starts from MNTP's export
    assert simcse.data.unit_shards == simcse.data.shards and not simcse.data.build_if_missing
    for full, smoke in ((mntp, experiment("mntp-smoke.yaml")), (simcse, experiment("simcse-smoke.yaml"))):
        assert [{k: v for k, v in to_dict(o).items() if k != "mask_token"} for o in full.phases[0].objectives] == \
            [{k: v for k, v in to_dict(o).items() if k != "mask_token"} for o in smoke.phases[0].objectives]
        assert smoke.model.attention_dropout == full.model.attention_dropout
        assert smoke.phases[0].document_masking == full.phases[0].document_masking
    assert experiment("simcse-smoke.yaml").model.init == os.path.join(experiment("mntp-smoke.yaml").run_dir, "hf")
    objective = make_objective(simcse.phases[0].objectives[0], load_tokenizer(TOKENIZER))
    assert isinstance(objective, SimCSE) and objective.scale == 20.0
    supervised, smoke = experiment("supervised.yaml"), experiment("supervised-smoke.yaml")
    (spec,) = supervised.phases[0].objectives
    assert (spec.name, spec.scale, spec.hard_negatives, spec.mask_collisions, spec.grad_cache) == (
        "supervised", 50.0, True, True, True)
    t = supervised.train
    assert (t.steps, t.micro_batch * t.grad_accum * GPUS, supervised.data.seq_len) == (1000, 512, 3 * 512)
    assert (supervised.optim.lr, supervised.optim.warmup_steps, supervised.optim.weight_decay) == (2e-4, 300, 0.0)
    assert supervised.model.init == os.path.join(mntp.run_dir, "hf")  # LLM2Vec starts it from MNTP, not SimCSE
    assert supervised.data.pair_shards == supervised.data.shards and not supervised.data.build_if_missing
    assert to_dict(smoke.phases[0].objectives) == to_dict(supervised.phases[0].objectives)
    assert smoke.model.init == os.path.join(experiment("mntp-smoke.yaml").run_dir, "hf")
    mntp_lora = experiment("mntp-lora.yaml")
    for name in ("mntp", "simcse", "supervised"):  # the paper's adapters on the same recipe; each stage a new one
        full, lora = experiment(f"{name}.yaml"), experiment(f"{name}-lora.yaml")
        assert (lora.model.lora.r, lora.model.lora.alpha, lora.model.lora.dropout) == (16, 32.0, 0.05)
        assert lora.model.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        assert full.model.lora.r == 0 and lora.run_dir != full.run_dir
        assert (to_dict(lora.phases), to_dict(lora.optim), to_dict(lora.train)) == (
            to_dict(full.phases), to_dict(full.optim), to_dict(full.train))
        if name != "mntp":  # from the merged export of the LoRA MNTP run
            assert lora.model.init == lora.data.tokenizer == os.path.join(mntp_lora.run_dir, "hf")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    """(packed shards of 64 tokens, sentence-unit shards of 32 tokens) of a few sample-corpus documents."""
    root = tmp_path_factory.mktemp("llm2vec-data")
    corpus = write_jsonl_zst(root / "docs.jsonl.zst", documents(HOLDOUT, max_chars=3000)[:20])
    packed, units = str(root / "packed"), str(root / "units")
    run_job(BuildConfig(inputs=(corpus,), tokenizer=TOKENIZER, output=packed, seq_len=64, progress=False))
    run_job(BuildConfig(inputs=(corpus,), tokenizer=TOKENIZER, output=units, seq_len=32, units="sentence",
                        progress=False))
    return packed, units


@pytest.mark.e2e
@pytest.mark.slow  # ~1 min of launches: the slow suite keeps make test under 20 min
@pytest.mark.extended  # tests/e2e/test_llm2vec_chain.py runs MNTP then SimCSE from its export, from SmolLM2
def test_smoke_recipe_mntp_then_simcse_on_two_zero3_ranks(data, tmp_path):
    packed, units = data
    mntp = str(tmp_path / "mntp")
    launch_training(mntp, os.path.join(EXPERIMENTS, "mntp-smoke.yaml"), f"data.shards={packed}",
                    "data.build_if_missing=false")
    steps = logged_steps(mntp)
    assert sorted(steps) == list(range(1, 9)) and all(math.isfinite(s["loss/mntp"]) for s in steps.values())
    check_mntp_export(mntp, tmp_path)
    simcse = str(tmp_path / "simcse")
    launch_training(simcse, os.path.join(EXPERIMENTS, "simcse-smoke.yaml"), f"data.shards={units}",
                    f"data.unit_shards={units}", f"model.init={os.path.join(mntp, 'hf')}")
    steps = logged_steps(simcse)
    assert read_record(AutoConfig.from_pretrained(os.path.join(simcse, "hf"))) == EncoderRecord(
        attention="bidirectional", reads_previous=True, mask_token="<mask>", pooling="mean", layout="bos_eos",
        objectives=("mntp", "simcse"))  # what the MNTP start export recorded carries over
    assert sorted(steps) == list(range(1, 9))
    losses = [steps[s]["loss/simcse"] for s in range(1, 9)]
    assert all(0 < loss < math.log(16) + 1 for loss in losses)  # 16 units a step over both ranks
    assert sum(losses[-3:]) / 3 < losses[0]  # it learns to tell the units apart


def check_mntp_export(run: str, tmp_path) -> None:
    """The trained MNTP export records its training, and a moved copy loads bidirectional with transformers alone
    (fresh process, project not importable) with the project's hidden states; launch/export_hf.py writes the
    sentence-transformers export of the same run, which embeds as encode() does."""
    hf = os.path.join(run, "hf")
    record = read_record(AutoConfig.from_pretrained(hf))
    assert record == EncoderRecord(attention="bidirectional", reads_previous=True, mask_token="<mask>",
                                   pooling="mean", layout="bos_eos", objectives=("mntp",))
    moved = str(tmp_path / "moved" / "mntp-encoder")
    shutil.copytree(hf, moved)
    model = load_model(moved)
    assert (model.attention, model.reads_previous, model.run_dir) == ("bidirectional", True, None)
    texts = ["The king is dead.", "Long live the king, and all his court and the realm."]
    rows = [[model.tokenizer.bos_id, *ids, model.tokenizer.eos_id] for ids in model.tokenizer.encode_batch(texts)]
    ids, doc_ids = pad_rows(rows, pad_id(model.tokenizer))
    mask = (doc_ids >= 0).long()
    plain, _ = plain_transformers_hidden(moved, ids.tolist(), mask.tolist())
    with torch.no_grad():
        ours = hidden_states(model.lm, ids, doc_ids, model.attention).numpy()
    for row, r in enumerate(rows):
        np.testing.assert_allclose(plain[row, :len(r)], ours[row, :len(r)], atol=1e-5)
    st_dir = str(tmp_path / "mntp-st")
    cmd = [sys.executable, os.path.join(REPO, "launch", "export_hf.py"), "--run", run, "--output", st_dir,
           "--sentence-transformers"]
    # mean pooling over bos_eos, which sentence-transformers' mean cannot reproduce: the nearest layout, the text
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_record(AutoConfig.from_pretrained(st_dir)).layout == "text"
    from sentence_transformers import SentenceTransformer

    np.testing.assert_allclose(SentenceTransformer(st_dir, device="cpu").encode(texts),
                               encode(load_model(st_dir), texts), atol=1e-5)


def test_bad_input_is_refused_by_the_trainer(data, tmp_path):
    """The trainer's own steps, in process: checking the data sources before start-up (SimCSE pointed at packed
    shards) and the model (an MNTP export that does not exist, or a checkpoint of another architecture), both in preflight."""
    packed, units = data
    exp = experiment("simcse-smoke.yaml", f"data.shards={units}", f"data.unit_shards={packed}",
                     f"run_dir={tmp_path / 'run'}", "model.init=tiny")
    tokenizer = load_tokenizer(TOKENIZER)
    with pytest.raises(ValueError, match=rf"data.unit_shards {packed} holds packed samples .* but simcse reads "
                                         r"sentence units, one a sample; build unit shards with"), \
            preflight(exp, rank=0, world=1):
        pass
    no_zero = {"zero_optimization": {"stage": 0}}
    missing = str(tmp_path / "no-such-mntp-run" / "hf")
    with pytest.raises(ValueError, match=rf"no such directory {missing!r}; the model must be one of the presets"):
        check_model(experiment("simcse-smoke.yaml", f"model.init={missing}"), tokenizer, no_zero, cuda=False)
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": tokenizer.info.vocab_size}))
    with pytest.raises(ValueError, match="config.json: model_type 'gpt2' is not supported; supported architectures"):
        check_model(experiment("simcse-smoke.yaml", f"model.init={other}"), tokenizer, no_zero, cuda=False)
