"""Model presets, checkpoint loading, parameter and FLOP counts."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest
import torch
import warm
from helpers import one_rank_env, rendezvous
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from pipeline.model.build import build_model, model_spec
from pipeline.model.flops import body_work, flops_per_token, param_counts, segment_lengths
from pipeline.model.presets import PRESETS, get_preset

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))


def test_tiny_architecture():
    model = build_model(model_spec("tiny", 64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 256)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert cfg.hidden_act == "silu" and cfg.rope_parameters["rope_theta"] == 10000.0
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total


@pytest.mark.parametrize("name, vocab, expected", [
    ("210m", 128256, 211_766_016),  # embeddings once, no LM head: the paper's "210M"
    ("610m", 128256, 607_874_688),
    ("1b", 128256, 1_187_856_576),
    ("7b", 32000, 6_738_415_616 - 32000 * 4096),  # Llama-2-7B's published 6,738,415,616 includes its LM head
    ("8b", 128256, 8_030_261_248 - 128256 * 4096),  # Llama-3-8B's published 8,030,261,248 likewise
])
def test_preset_parameter_counts_on_meta(name, vocab, expected):
    with torch.device("meta"):
        model = build_model(model_spec(name, vocab))
    preset = get_preset(name)
    assert model.model.layers[-1].mlp.up_proj.weight.shape == (preset.ffn_size, preset.hidden_size)
    assert len(model.model.layers) == preset.num_layers
    total = sum(p.numel() for p in model.parameters())
    counts = param_counts(model.config)
    assert total == counts.total == expected + vocab * preset.hidden_size
    assert counts.embedding + counts.body == expected
    head_dim = preset.hidden_size // preset.num_heads
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (preset.num_kv_heads * head_dim, preset.hidden_size)
    assert model.config.rope_parameters["rope_theta"] == preset.rope_theta
    if name == "8b":  # Llama-3-8B: grouped-query attention, 4 query heads per KV head
        assert (preset.num_kv_heads, head_dim, model.config.max_position_embeddings) == (8, 128, 8192)


def test_flops_per_token_matches_torch_flop_counter():
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64, attn_implementation="eager"))
    batch, seq_len = 2, 32
    input_ids = torch.randint(0, 64, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    expected = flops_per_token(model.config, seq_len) * batch * seq_len
    # the closed form counts the RMSNorm weights as matmul parameters (0.5 % of the tiny body)
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)
    head = 6 * 64 * 64
    assert flops_per_token(model.config, seq_len, head_fraction=0.25) == pytest.approx(
        flops_per_token(model.config, seq_len) - 0.75 * head)


def test_body_work_squares_each_attention_segment():
    """Attention counts each document's own square (each row's, without document masking); padding is no token."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0], [-1] * 6])
    assert body_work(segment_lengths(doc_ids, document_masking=True)).tolist() == [11, 3 * 3 + 2 * 2 + 6 * 6]
    assert body_work(segment_lengths(doc_ids, document_masking=False)).tolist() == [11, 5 * 5 + 6 * 6]


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny, 20m, 210m, 610m, 1b, 7b, 8b"):
        build_model(model_spec("huge", 64))
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")


def test_the_docs_list_the_presets_the_errors_list():
    """Issue 51, item 6: the error listed 20m, which the README's and training.md's lists of presets left out."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    lists = {"README.md": "Models: presets ", "docs/training.md": "| `model.init` | `tiny` | a preset ("}
    for doc, start in lists.items():
        text = open(os.path.join(repo, doc)).read()
        named = re.findall(r"`([\w-]+)`", text.split(start, 1)[1].split(")", 1)[0].split(" (")[0])
        assert named == list(PRESETS), doc
    table = re.findall(r"^\| `([\w-]+)` \|", open(os.path.join(repo, "docs", "models.md")).read(), re.M)
    assert table[:len(PRESETS)] == list(PRESETS)


def test_bad_checkpoint_directories(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        build_model(model_spec(str(tmp_path / "missing"), 64))
    with pytest.raises(ValueError, match="no config.json"):
        build_model(model_spec(str(tmp_path), 64))
    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported architectures: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text"):
        build_model(model_spec(str(tmp_path / "bert"), 64))


def test_checkpoint_round_trip_and_tokenizer_checks(tmp_path):
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64, bos_token_id=1, eos_token_id=2)).eval()
    model.save_pretrained(tmp_path)
    loaded = build_model(model_spec(str(tmp_path), 64, attn_implementation="eager", bos_token_id=1, eos_token_id=2)).eval()
    assert loaded.config._attn_implementation == "eager"
    input_ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)
    with pytest.raises(ValueError, match=r"config.json: vocab_size 64 does not match the data tokenizer's 65"):
        build_model(model_spec(str(tmp_path), 65))
    with pytest.raises(ValueError, match=r"eos_token_id 2 differs from the data tokenizer's 3"):
        build_model(model_spec(str(tmp_path), 64, eos_token_id=3))


def test_mistral_checkpoint_loads(tmp_path):
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, eos_token_id=[2, 5])
    MistralForCausalLM(config).save_pretrained(tmp_path)
    model = build_model(model_spec(str(tmp_path), 64, eos_token_id=5))
    assert isinstance(model, MistralForCausalLM) and model.config.use_cache is False


@pytest.mark.e2e
@pytest.mark.slow
def test_zero3_build_is_partitioned_and_keeps_hf_init():
    """Under a live HfDeepSpeedConfig (stage 3) the model is built partitioned, with HF's weight init."""
    script = textwrap.dedent("""
        import json, deepspeed
        from transformers.integrations import HfDeepSpeedConfig
        from pipeline.model.build import build_model, model_spec
        deepspeed.init_distributed(dist_backend="gloo")
        keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
        model = build_model(model_spec("tiny", 64))
        up, embed = model.model.layers[0].mlp.up_proj.weight, model.model.embed_tokens.weight
        with deepspeed.zero.GatheredParameters([up, embed]):
            full = [list(up.shape), up.std().item(), embed.std().item()]
        print(json.dumps({"local": up.numel(), "ds_numel": up.ds_numel, "full": full}))
    """)
    with rendezvous() as rdzv:
        proc = warm.run(code=script, env=one_rank_env(rdzv), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["local"] == 0 and result["ds_numel"] == 128 * 64  # partitioned: nothing materialised locally
    shape, up_std, embed_std = result["full"]
    assert shape == [128, 64]
    # HF's normal(0, 0.02) init; a bare zero.Init keeps torch's defaults (std 0.07 for this Linear, 1 for Embedding)
    init_std = PRESETS["tiny"].to_config(64).initializer_range
    assert up_std == pytest.approx(init_std, rel=0.1) and embed_std == pytest.approx(init_std, rel=0.1)
