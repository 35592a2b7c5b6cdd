"""An export stays an encoder: its config.json records how it was trained, plain transformers (in a fresh process,
without the project) runs it as trained, ``load_model`` reads the record of a copy moved anywhere, and the
sentence-transformers export embeds as ``encode`` does, through the real sentence-transformers package."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from helpers import ONE_RANK, REPO, launch_training, plain_transformers_hidden, tiny_llama
from huggingface_hub.repocard_data import model_index_to_eval_results
from transformers import LlamaForCausalLM

from pipeline.config import from_dict
from pipeline.data.format.instructions import special_tokens
from pipeline.eval import encode, load_model
from pipeline.eval.forward import hidden_states, pad_id, pad_rows
from pipeline.eval.results import EvalResults
from pipeline.eval.runner import main as evaluate_main
from pipeline.experiment import ExperimentConfig, load_experiment
from pipeline.export.card import embed_snippet
from pipeline.export.hf import ExportError, save_hf, truncate_dim_of
from pipeline.export.record import EncoderRecord, from_experiment, read_record
from pipeline.export.sentence_transformers import check_expressible, st_record
from pipeline.model.build import build_model, model_spec
from pipeline.run_dir import RunDir
from pipeline.tokenizer import load_tokenizer

TEXTS = ["The river rises in the hills.", "A much longer sentence about the hills, the river and the sea beyond.",
         "Short."]
DOC_PATH = "runs/llm2vec-mntp/hf"  # the export the README's and docs/export.md's snippet loads
MNTP = EncoderRecord(attention="bidirectional", reads_previous=True, mask_token="<mask>", layout="bos_eos",
                     objectives=("mntp",))


def export(tokenizer, out: str, record: EncoderRecord, sentence_transformers: bool = False) -> str:
    lm = tiny_llama(tokenizer, seed=3)
    return save_hf(lm, lm.state_dict(), tokenizer, out, record, experiment({}), 0,
                   sentence_transformers=sentence_transformers)


def padded(tokenizer, texts=TEXTS) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Right-padded BOS text EOS rows: (ids, 0/1 mask, row lengths)."""
    rows = [[tokenizer.bos_id, *ids, tokenizer.eos_id] for ids in tokenizer.encode_batch(texts)]
    width = max(map(len, rows))
    return ([r + [pad_id(tokenizer)] * (width - len(r)) for r in rows],
            [[1] * len(r) + [0] * (width - len(r)) for r in rows], [len(r) for r in rows])


def project_hidden(hf_dir: str, ids: list[list[int]], lengths: list[int], attention: str = "auto") -> np.ndarray:
    model = load_model(hf_dir, attention=attention)
    input_ids, doc_ids = pad_rows([r[:n] for r, n in zip(ids, lengths)], pad_id(model.tokenizer))
    with torch.no_grad():
        return hidden_states(model.lm, input_ids, doc_ids, model.attention).numpy()


def test_records_of_the_shipped_experiments(tokenizer):
    def record(path, *overrides):
        return from_experiment(load_experiment(os.path.join(REPO, "experiments", path), list(overrides)), tokenizer)

    mntp = record("llm2vec/mntp.yaml")
    assert mntp == EncoderRecord(attention="bidirectional", reads_previous=True, mask_token="_", pooling="mean",
                                 layout="bos_eos", objectives=("mntp",))
    assert record("llm2vec/mntp-smoke.yaml").mask_token == "<mask>"
    clm = from_experiment(experiment({"phases": [{"objectives": [{"name": "clm"}]}]}), tokenizer)
    assert (clm.attention, clm.reads_previous, clm.mask_token) == ("causal", False, None)
    switch = from_experiment(experiment({"phases": [{"share": 0.5, "objectives": [{"name": "clm"}]},
                                                    {"share": 0.5, "objectives": [{"name": "mlm", "ratio": 0.4}]}]}),
                             tokenizer)
    assert (switch.attention, switch.reads_previous, switch.mask_token) == ("bidirectional", False, "<mask>")
    assert switch.objectives == ("clm", "mlm")


def experiment(raw: dict) -> ExperimentConfig:
    return from_dict(ExperimentConfig, raw)


def test_the_record_keeps_the_runs_own_sscl_instruction(tokenizer):
    """encode(), sentence-transformers and MTEB embed with the record's instruction: it must be the trained one."""
    own = "Represent this review for finding similar reviews:"
    sscl = {"name": "sscl", "augment": "delete", "instruction": own}
    record = from_experiment(experiment({"phases": [{"objectives": [sscl]}]}), tokenizer)
    assert (record.instruction, record.pooling, record.attention) == (own, "last", "bidirectional")
    default = from_experiment(experiment({"phases": [{"objectives": [{"name": "sscl", "augment": "delete"}]}]}),
                              tokenizer)
    assert default.instruction == "Given the sentence, find its representation:"


def test_simcse_after_mntp_keeps_the_start_exports_record(tokenizer, tmp_path):
    start = export(tokenizer, str(tmp_path / "mntp"), MNTP)
    simcse = from_experiment(experiment({"model": {"init": start, "attention_dropout": 0.3},
                                         "phases": [{"objectives": [{"name": "simcse"}]}]}), tokenizer)
    assert (simcse.attention, simcse.reads_previous, simcse.mask_token) == ("bidirectional", True, "<mask>")
    assert simcse.objectives == ("mntp", "simcse") and simcse.pooling == "mean"


@pytest.mark.e2e
def test_bidirectional_export_loads_bidirectional_in_plain_transformers_anywhere(tokenizer, tmp_path):
    hf = export(tokenizer, str(tmp_path / "run" / "hf"), MNTP)
    config = json.load(open(os.path.join(hf, "config.json")))
    assert config["is_causal"] is False and read_record(config) == MNTP
    moved = str(tmp_path / "elsewhere" / "copy")
    shutil.copytree(hf, moved)
    shutil.rmtree(hf)
    ids, mask, lengths = padded(tokenizer)
    plain, cls = plain_transformers_hidden(moved, ids, mask)
    assert cls == "LlamaModel"
    ours = project_hidden(moved, ids, lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(plain[row, :n], ours[row, :n], atol=1e-5)
    # bidirectional: the first token's state depends on the last token
    changed = [r[:] for r in ids]
    changed[0][lengths[0] - 2] = changed[0][1]
    again, _ = plain_transformers_hidden(moved, changed, mask)
    assert np.abs(again[0, 0] - plain[0, 0]).max() > 1e-4
    # the project's own causal reading of the same export is still causal (it passes its masks itself)
    causal = project_hidden(moved, ids, lengths, attention="causal")
    assert np.abs(causal[0, 0] - ours[0, 0]).max() > 1e-4
    model = load_model(moved)
    assert (model.attention, model.reads_previous, model.run_dir, model.record.mask_token) == (
        "bidirectional", True, None, "<mask>")


@pytest.mark.e2e
def test_causal_export_stays_causal(tokenizer, tmp_path):
    hf = export(tokenizer, str(tmp_path / "clm"), EncoderRecord(layout="bos_eos", objectives=("clm",)))
    assert json.load(open(os.path.join(hf, "config.json")))["is_causal"] is True
    ids, mask, lengths = padded(tokenizer)
    plain, _ = plain_transformers_hidden(hf, ids, mask)
    ours = project_hidden(hf, ids, lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(plain[row, :n], ours[row, :n], atol=1e-5)
    assert load_model(hf).attention == "causal"


def test_an_export_that_dies_midway_leaves_no_directory_that_loads_as_one(tokenizer, tmp_path):
    """An export is written beside its place and renamed in (issue 55, item 6): one that fails after its weights
    (here the tokenizer's files vanished before they were copied) leaves the previous export as it was, and where
    there was none, no directory at all; the next export succeeds."""
    out = str(tmp_path / "run" / "hf")
    export(tokenizer, out, MNTP)
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    shutil.copytree(tokenizer.path, tmp_path / "tok")
    broken = load_tokenizer(str(tmp_path / "tok"))
    os.remove(next(iter(broken.files.values())))
    lm = tiny_llama(tokenizer, seed=4)
    for where in (out, str(tmp_path / "new")):
        with pytest.raises(FileNotFoundError):
            save_hf(lm, lm.state_dict(), broken, where, MNTP, experiment({}), 0)
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["run", "tok"] and os.listdir(tmp_path / "run") == ["hf"]
    assert export(tokenizer, str(tmp_path / "new"), MNTP) and load_model(str(tmp_path / "new")).step is None
    with pytest.raises(ExportError, match=rf"^{tmp_path}/tok: a directory that holds no export; an export "):
        export(tokenizer, str(tmp_path / "tok"), MNTP)


def test_no_progress_quiets_deepspeeds_bars_of_a_zero_checkpoint(tmp_path, capsys):
    """Issue 51, item 6: ``launch/evaluate.py --no-progress`` still drew zero_to_fp32's "Loading checkpoint shards"
    and "Gathering sharded weights" bars as it exported a ZeRO checkpoint (here the fixture's ZeRO-3 one)."""
    from pipeline.eval.runner import no_library_bars
    from pipeline.export.hf import checkpoint_state_dict

    run = RunDir(str(tmp_path / "run"))
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "old_checkpoint", "step00000002"), run.checkpoint(2))
    with no_library_bars():
        quiet = checkpoint_state_dict(run, 2)
    assert "Gathering sharded weights" not in capsys.readouterr().err
    drawn = checkpoint_state_dict(run, 2)
    assert "Gathering sharded weights" in capsys.readouterr().err and quiet.keys() == drawn.keys()


def test_layouts(tokenizer, tmp_path):
    assert special_tokens(tokenizer, "bos_eos") == ([tokenizer.bos_id], [tokenizer.eos_id])
    assert special_tokens(tokenizer, "special") == ([tokenizer.bos_id], [])  # the sample tokenizer adds BOS only
    assert special_tokens(tokenizer, "text") == ([], [])
    with pytest.raises(ValueError, match="layout 'raw' is not one of bos_eos, special, text"):
        special_tokens(tokenizer, "raw")
    model = load_model(export(tokenizer, str(tmp_path / "hf"), MNTP))
    (text,) = tokenizer.encode_batch([TEXTS[0]])
    for layout, ids in (("bos_eos", [tokenizer.bos_id, *text, tokenizer.eos_id]), ("special", [tokenizer.bos_id, *text]),
                        ("text", text)):
        start = 0 if layout == "text" else 1
        with torch.no_grad():
            hidden = model.lm.model(input_ids=torch.tensor([ids]), is_causal=False).last_hidden_state[0]
        np.testing.assert_allclose(encode(model, TEXTS[:1], layout=layout)[0],
                                   hidden[start:start + len(text)].mean(0).numpy(), atol=1e-5)
    assert encode(model, TEXTS[:1]).tolist() == encode(model, TEXTS[:1], layout="bos_eos").tolist()  # recorded


@pytest.mark.parametrize("pooling, layout", [("mean", "text"), ("last", "special"), ("last", "text")])
def test_sentence_transformers_export_embeds_as_encode(tokenizer, tmp_path, pooling, layout):
    from sentence_transformers import SentenceTransformer

    record = EncoderRecord(attention="bidirectional", pooling=pooling, layout=layout,
                           instruction="Represent the sentence: ")
    hf = export(tokenizer, str(tmp_path / "st"), record, sentence_transformers=True)
    st = SentenceTransformer(hf, device="cpu")
    model = load_model(hf)
    with_prompt = st.encode(TEXTS, batch_size=2)  # the recorded instruction is the default prompt
    np.testing.assert_allclose(with_prompt, encode(model, TEXTS), atol=1e-5)
    np.testing.assert_allclose(st.encode(TEXTS, prompt=""), encode(model, TEXTS, instruction=""), atol=1e-5)
    assert np.abs(with_prompt - st.encode(TEXTS, prompt="")).max() > 1e-4  # the prompt conditions the text


def test_matryoshka_dims_are_recorded_and_truncate_dim_cuts_encode_and_sentence_transformers(tokenizer, tmp_path):
    """A Matryoshka run records its dims; an export asked for ``truncate_dim`` embeds with that many leading dims in
    encode() and in sentence-transformers (its own ``truncate_dim``); an export without either writes neither key,
    so its config.json keeps the bytes it had."""
    from sentence_transformers import SentenceTransformer

    supervised = {"name": "supervised", "matryoshka": {"dims": [64, 16], "weights": [1.0, 0.5]}}
    trained = from_experiment(experiment({"phases": [{"objectives": [supervised]}]}), tokenizer)
    assert trained.matryoshka_dims == (64, 16) and trained.truncate_dim is None
    record = st_record(trained, pooling="mean")
    hf = export(tokenizer, str(tmp_path / "cut"), dataclasses.replace(record, truncate_dim=16),
                sentence_transformers=True)
    with open(os.path.join(hf, "config_sentence_transformers.json")) as f:
        assert json.load(f)["truncate_dim"] == 16
    model = load_model(hf)
    assert model.record.matryoshka_dims == (64, 16) and model.record.truncate_dim == 16
    full = encode(model, TEXTS, dim=64)
    cut = encode(model, TEXTS)
    assert full.shape == (3, 64) and cut.shape == (3, 16) and cut.tolist() == full[:, :16].tolist()
    np.testing.assert_allclose(SentenceTransformer(hf, device="cpu").encode(TEXTS), cut, atol=1e-5)
    with pytest.raises(ValueError, match="dim 65: the model's embeddings have 64 dims; pass 1 to 64"):
        encode(model, TEXTS, dim=65)
    plain = export(tokenizer, str(tmp_path / "plain"), st_record(MNTP), sentence_transformers=True)
    for name in ("config.json", "config_sentence_transformers.json"):
        with open(os.path.join(plain, name)) as f:
            assert not {"matryoshka_dims", "truncate_dim"} & set(re.findall(r'"(\w+)"', f.read())), name
    with pytest.raises(ExportError, match=r"--truncate-dim 32: the run trained the dims \[64, 16\] .* pass one"):
        truncate_dim_of(32, 64, trained)
    with pytest.raises(ExportError, match=r"--truncate-dim 128: the model's embeddings have 64 dims; pass 1 to 64"):
        truncate_dim_of(128, 64, MNTP)


def test_sentence_transformers_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="equals encode\\(\\)'s mean only under layout 'text'.*--layout text"):
        check_expressible(EncoderRecord(pooling="mean", layout="bos_eos"))
    with pytest.raises(ValueError, match="pooling 'weighted_mean' has no sentence-transformers equivalent"):
        check_expressible(EncoderRecord(pooling="weighted_mean", layout="text"))
    with pytest.raises(ValueError, match="not data prep's BOS/EOS; export with --layout special"):
        check_expressible(EncoderRecord(pooling="last", layout="bos_eos"))


def test_an_export_without_a_record_reads_its_runs_experiment_or_is_a_plain_decoder(tokenizer, tmp_path):
    """Exports written before records existed: inside their run, the run's experiment.json; alone, a plain decoder."""
    hf = export(tokenizer, str(tmp_path / "run" / "hf"), MNTP)
    config = json.load(open(os.path.join(hf, "config.json")))
    del config["decoder_encoders"], config["is_causal"]
    json.dump(config, open(os.path.join(hf, "config.json"), "w"))
    json.dump({"phases": [{"objectives": [{"name": "mntp", "mask_token": "<mask>"}]}]},
              open(tmp_path / "run" / "experiment.json", "w"))
    in_run = load_model(hf)
    assert (in_run.attention, in_run.reads_previous, in_run.record.mask_token) == ("bidirectional", True, "<mask>")
    alone = shutil.copytree(hf, str(tmp_path / "alone"))
    plain = load_model(alone)
    assert plain.record == EncoderRecord() and plain.attention == "causal" and plain.record.layout == "bos_eos"


def test_a_bad_record_names_the_file_and_field(tokenizer, tmp_path):
    from pipeline.eval.load import ModelError

    hf = export(tokenizer, str(tmp_path / "hf"), MNTP)
    config = json.load(open(os.path.join(hf, "config.json")))
    config["decoder_encoders"]["attention"] = "sideways"
    json.dump(config, open(os.path.join(hf, "config.json"), "w"))
    with pytest.raises(ModelError, match=r"hf/config.json: decoder_encoders.attention: 'sideways' is not one of "
                                         r"causal, bidirectional; re-export the model"):
        load_model(hf)


# Run in a fresh interpreter: every way an export is meant to be loaded (an encoder: its base class, sentence-
# transformers, the whole causal LM; a CLM export: the causal LM), each of which must be silent.
LOADS = """
import sys
from transformers import AutoModel, AutoModelForCausalLM
if sys.argv[2] == "encoder":
    from sentence_transformers import SentenceTransformer
    AutoModel.from_pretrained(sys.argv[1])
    SentenceTransformer(sys.argv[1], device="cpu")
    AutoModelForCausalLM.from_pretrained(sys.argv[1], variant="lm")
else:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
"""


@pytest.mark.e2e
def test_exports_load_silently_with_the_classes_they_name(tokenizer, tmp_path):
    """transformers 5 printed a LOAD REPORT (lm_head.weight UNEXPECTED) for every AutoModel load of an export."""
    encoder = export(tokenizer, str(tmp_path / "mntp"), st_record(MNTP), sentence_transformers=True)
    clm = export(tokenizer, str(tmp_path / "clm"), EncoderRecord(objectives=("clm",)))
    config = tiny_llama(tokenizer).config
    config.tie_word_embeddings = True  # as SmolLM2: the head is the embedding, kept once
    tied_lm = LlamaForCausalLM(config)
    tied = save_hf(tied_lm, tied_lm.state_dict(), tokenizer, str(tmp_path / "tied"), MNTP, experiment({}), 0)
    assert json.load(open(os.path.join(encoder, "config.json")))["architectures"] == ["LlamaModel"]
    assert json.load(open(os.path.join(clm, "config.json")))["architectures"] == ["LlamaForCausalLM"]
    assert os.path.exists(os.path.join(encoder, "lm_head.safetensors"))
    assert not os.path.exists(os.path.join(tied, "lm_head.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for hf, kind in ((encoder, "encoder"), (tied, "encoder"), (clm, "clm")):
        proc = subprocess.run([sys.executable, "-c", LOADS, hf, kind], capture_output=True, text=True, env=env,
                              cwd=str(tmp_path), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        output = proc.stdout + proc.stderr
        assert not any(word in output for word in ("LOAD REPORT", "UNEXPECTED", "MISSING")), output[-3000:]
    # the LM head MNTP evaluation, infilling and a run continued from the export need: the project's loader, its
    # model.init and transformers' variant read it
    head = tiny_llama(tokenizer, seed=3).lm_head.weight
    torch.testing.assert_close(load_model(encoder).lm.lm_head.weight, head, rtol=0, atol=0)
    torch.testing.assert_close(build_model(model_spec(encoder, tokenizer.info.vocab_size)).lm_head.weight, head, rtol=0, atol=0)
    from transformers import AutoModelForCausalLM

    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(encoder, variant="lm").lm_head.weight, head,
                               rtol=0, atol=0)
    loaded = load_model(tied).lm
    torch.testing.assert_close(loaded.lm_head.weight, tied_lm.model.embed_tokens.weight, rtol=0, atol=0)


def card_of(hf_dir: str) -> tuple[dict, str]:
    """(YAML front matter, body) of an export's README.md."""
    text = open(os.path.join(hf_dir, "README.md")).read()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def snippet_in(markdown: str, path: str) -> str:
    """The python block of ``markdown`` that loads ``path``."""
    blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(REPO, markdown)).read(), re.S)
    return next(b for b in blocks if f'path = "{path}"' in b)


@pytest.mark.parametrize("record", [MNTP, EncoderRecord(attention="bidirectional", pooling="last", layout="special",
                                                        instruction="Represent the sentence: ", objectives=("sscl",))],
                         ids=["mean-bos_eos", "last-special-instruction"])
def test_the_documented_transformers_snippet_embeds_as_encode(tokenizer, tmp_path, record):
    """The README's snippet tokenized BOS + text (and pooled nothing), not encode()'s BOS + text + EOS."""
    hf = export(tokenizer, str(tmp_path / "hf"), record)
    code = embed_snippet(hf, record, special_tokens(tokenizer, "special"))
    meta, body = card_of(hf)
    assert embed_snippet(".", record, special_tokens(tokenizer, "special")) in body
    assert meta["pipeline_tag"] == "feature-extraction"
    if record == MNTP:  # the README and docs/export.md show this very code
        for markdown in ("README.md", "docs/export.md"):
            assert snippet_in(markdown, DOC_PATH) == embed_snippet(DOC_PATH, record, ([], [])), markdown
    scope = {}
    exec(code, scope)
    np.testing.assert_allclose(scope["embeddings"].numpy(), encode(load_model(hf), scope["texts"], instruction=""),
                               atol=1e-5)


@pytest.mark.e2e
def test_a_lora_mntp_run_exports_a_card_a_sentence_transformer_and_its_adapter(shards, init_dir, tokenizer, tmp_path):
    """One run, engine and offline exports: the model card; train.export_sentence_transformers and the offline
    --sentence-transformers with its own defaults (which asked for --layout text on a mean-pooled run); the LoRA
    adapter that PEFT puts on the run's start model, giving the merged export's states, and whose merge by PEFT
    equals the export's weights."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig, AutoModel

    run = str(tmp_path / "run")
    launch_training(run, os.path.join(REPO, "experiments", "llm2vec", "mntp-smoke.yaml"), f"data.shards={shards}",
                    f"model.init={init_dir}", "model.lora.r=4", "model.lora.targets=[q_proj, v_proj]",
                    "train.steps=2", "checkpoint.every=2", "train.export_sentence_transformers=true", **ONE_RANK)
    # the run's hf/ at step 2: evaluate.py puts the results in its card, the offline export of step 2 in its own
    assert evaluate_main(["--model", run, "--tasks", "sts", "--data-dir", os.path.join(REPO, "tests", "fixtures", "eval"),
                          "--no-progress"]) == 0
    evaluated = EvalResults.read(RunDir(run).eval_results())
    offline = str(tmp_path / "offline")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "export_hf.py"), "--run", run, "--output",
                           offline, "--sentence-transformers"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for hf in (os.path.join(run, "hf"), offline):
        meta, body = card_of(hf)
        _, parsed = model_index_to_eval_results(meta.pop("model-index"))
        assert {(r.dataset_type, r.metric_type): r.metric_value for r in parsed} == {
            (name, "cos_sim_spearman"): r["spearman"] for name, r in evaluated.results["sts"]["datasets"].items()}, hf
        assert meta == {"library_name": "sentence-transformers",  # a local start: no base_model, no license known
                        "pipeline_tag": "feature-extraction",
                        "tags": ["decoder-encoders", "llm2vec", "mntp", "sentence-transformers", "lora"]}, hf
        assert f"`{os.path.basename(shards)}`" in body and "step 2 of 2 (" in body and " tokens)" in body, body
        assert shards not in body and init_dir not in body
        model = load_model(hf)
        assert (model.record.pooling, model.record.layout) == ("mean", "text")  # what sentence-transformers reads
        np.testing.assert_allclose(SentenceTransformer(hf, device="cpu").encode(TEXTS), encode(model, TEXTS),
                                   atol=1e-5)
    hf = os.path.join(run, "hf")
    adapter = os.path.join(hf, "adapter")
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"] == init_dir
    ids, mask, _ = padded(tokenizer)
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    config = AutoConfig.from_pretrained(init_dir)
    config.is_causal = False  # the start model read as the run trained it (the export's config.json says so)
    with torch.no_grad():
        merged = AutoModel.from_pretrained(hf).eval()(**batch).last_hidden_state
        peft = PeftModel.from_pretrained(AutoModel.from_pretrained(init_dir, config=config), adapter).eval()
        torch.testing.assert_close(peft(**batch).last_hidden_state, merged, atol=1e-5, rtol=0)
        base = AutoModel.from_pretrained(init_dir, config=config).eval()(**batch).last_hidden_state
        assert (base - merged).abs().max() > 1e-4  # the adapter trained
    ours = load_file(os.path.join(hf, "model.safetensors"))
    for name, weight in peft.merge_and_unload().state_dict().items():
        torch.testing.assert_close(weight, ours["model." + name], atol=1e-6, rtol=0)  # PEFT's merge is ours


@pytest.mark.parametrize("start", ["causal", "encoder"])
def test_a_lora_adapter_loads_from_any_directory_as_its_merged_export(tokenizer, init_dir, tmp_path, monkeypatch,
                                                                       start):
    """Issue 51, finding 4: the adapter named its base as the run was given it (``runs/sample-tiny-clm/hf``), so
    PEFT found the base only from the directory the run started in; and its base loaded causal, while the merged
    export reads bidirectionally. The card's snippet, run from elsewhere, gives the merged export's states, with no
    LOAD REPORT, whether the base is a causal LM or an encoder export (LLM2Vec's SimCSE on its MNTP export);
    docs/export.md shows the same code."""
    import logging

    from peft import AutoPeftModelForFeatureExtraction
    from transformers import AutoModel, AutoModelForCausalLM

    from pipeline.export.card import adapter_snippet
    from pipeline.model.load_hf import causal_lm_kwargs
    from pipeline.model.lora import add_lora

    if start == "encoder":
        export(tokenizer, str(tmp_path / "start" / "hf"), MNTP)
    else:
        shutil.copytree(init_dir, tmp_path / "start" / "hf")
    monkeypatch.chdir(tmp_path)
    lm = AutoModelForCausalLM.from_pretrained("start/hf", **causal_lm_kwargs("start/hf"))
    add_lora(lm, r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj"))
    torch.manual_seed(0)
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter: B is no longer zero
    exp = experiment({"model": {"init": "start/hf", "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}}})
    hf = save_hf(lm, lm.state_dict(), tokenizer, str(tmp_path / "run" / "hf"), MNTP, exp, 0)
    assert json.load(open(os.path.join(hf, "adapter", "adapter_config.json")))["base_model_name_or_path"] == str(
        tmp_path / "start" / "hf")
    card = card_of(hf)[1]
    snippet = re.search(r"### The LoRA adapter alone.*?```python\n(.*?)```", card, re.S).group(1)
    assert snippet == adapter_snippet(".", encoder=True, base_variant=start == "encoder")
    assert snippet_in("docs/export.md", "runs/mntp-lora/hf") == adapter_snippet("runs/mntp-lora/hf", True, False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    ids, mask, _ = padded(tokenizer)
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    reports = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = reports.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        scope = {}
        exec(snippet.replace('path = "."', f'path = "{hf}"'), scope)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not reports, [r.getMessage() for r in reports]
    with torch.no_grad():
        merged = AutoModel.from_pretrained(hf).eval()(**batch).last_hidden_state
        torch.testing.assert_close(scope["model"](**batch).last_hidden_state, merged, atol=1e-5, rtol=0)
        # PEFT's own loader finds the base from here too, read with the base's own config: a causal LM's reads
        # causally (hence the snippet's config), an encoder export's as the merged export
        peft = AutoPeftModelForFeatureExtraction.from_pretrained(os.path.join(hf, "adapter")).eval()
        assert torch.allclose(peft(**batch).last_hidden_state, merged, atol=1e-5) == (start == "encoder")
