"""LoRA (``model.lora``): only the adapter trains, the export merges it into plain weights that transformers loads
alone, a resumed LoRA run continues exactly, and the planner counts the adapter's states only."""

from __future__ import annotations

import os

import pytest
import torch
import warm
from helpers import REPO, launch_training, logged_steps
from safetensors.torch import load_file
from transformers import AutoConfig

from pipeline.experiment import SAMPLE_DIR, load_experiment
from pipeline.model.build import build_model, model_spec
from pipeline.model.lora import LLM2VEC_TARGETS, add_lora, lora_params, merge_lora
from pipeline.planner.estimates import model_states
from pipeline.train.module import parameter_line

TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
RUN = ["train.steps=6", "train.micro_batch=2", "train.log_every=1", "optim.warmup_steps=0", "optim.decay_steps=0",
       "optim.lr=0.01", "checkpoint.every=3", "data.seq_len=64", "data.build_if_missing=false",
       "model.lora.r=4", "model.lora.dropout=0.1", "model.lora.targets=[q_proj, v_proj]"]


def test_only_the_adapter_trains_and_the_merge_computes_what_the_adapted_model_computes():
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64))
    add_lora(model, 4, 8.0, 0.0, LLM2VEC_TARGETS)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    adapter = lora_params(model.config, 4, LLM2VEC_TARGETS)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapter
    everything = sum(p.numel() for p in model.parameters())
    assert parameter_line(model) == (f"trainable params: {adapter:,} || all params: {everything:,} || "
                                     f"trainable%: {100 * adapter / everything:.4f}")  # as PEFT prints it
    with torch.no_grad():  # B starts at zero (the adapter's product is 0): make it count
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.randint(4, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model.eval()(input_ids=ids).logits
        plain = build_model(model_spec("tiny", 64))
        plain.load_state_dict(merge_lora(model.state_dict(), 8.0 / 4), strict=True)
        merged = plain.eval()(input_ids=ids).logits
        unmerged = build_model(model_spec("tiny", 64))
        unmerged.load_state_dict(merge_lora(model.state_dict(), 0.0), strict=True)
        assert not torch.allclose(unmerged.eval()(input_ids=ids).logits, adapted, atol=1e-3)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_lora_is_validated_and_counted_by_the_planner():
    exp = load_experiment(None, ["model.lora.r=16"])
    assert exp.model.lora.scale == 2.0 and exp.model.lora.targets == list(LLM2VEC_TARGETS)
    with pytest.raises(ValueError, match=r"model.lora.targets: \['qproj'\]; choose among"):
        load_experiment(None, ["model.lora.r=16", "model.lora.targets=[qproj]"])
    full = model_states(8_000_000_000, 500_000_000, 3, False, 1, 8)
    lora = model_states(8_000_000_000, 500_000_000, 3, False, 1, 8, trainable=42_000_000)
    assert lora.params16 == full.params16 and lora.adam == full.adam * 42 / 8000


@pytest.mark.e2e
@pytest.mark.slow  # several launches: the slow suite
def test_a_zero3_lora_run_exports_merged_weights_and_resumes_exactly(shards, init_dir, tmp_path):
    def run(name, *extra):
        proc = launch_training(str(tmp_path / name), None, *RUN, f"data.shards={shards}", f"model.init={init_dir}",
                               *extra)
        return str(tmp_path / name), proc.stdout

    straight, out = run("straight")
    config = AutoConfig.from_pretrained(init_dir)
    adapter, base = lora_params(config, 4, ("q_proj", "v_proj")), build_model(model_spec(init_dir, config.vocab_size))
    everything = adapter + sum(p.numel() for p in base.parameters())  # ZeRO-3 ranks hold parts: full sizes count
    assert (f"trainable params: {adapter:,} || all params: {everything:,} || "
            f"trainable%: {100 * adapter / everything:.4f}") in out
    start = load_file(os.path.join(init_dir, "model.safetensors"))
    engine = load_file(os.path.join(straight, "hf", "model.safetensors"))
    assert engine.keys() == start.keys()  # plain names: no adapter left in the export
    for name, weight in start.items():
        adapted = ".q_proj." in name or ".v_proj." in name
        assert torch.equal(engine[name], weight) != adapted, name  # only the adapted projections moved
    offline = str(tmp_path / "offline")
    proc = warm.run(os.path.join(REPO, "launch", "export_hf.py"), ["--run", straight, "--output", offline])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, weight in load_file(os.path.join(offline, "model.safetensors")).items():
        torch.testing.assert_close(weight, engine[name], atol=1e-6, rtol=0)  # fp32 master vs the 16-bit gather
    resumed, _ = run("resumed", "train.stop_at_step=3")
    run("resumed")
    losses = [{s: r["loss/clm"] for s, r in logged_steps(d).items()} for d in (straight, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 6  # LoRA dropout's RNG resumes too
