"""Build the model: a preset trained from scratch, or a local HF decoder checkpoint for continued pretraining.

Checkpoint families (``ARCHITECTURES``): Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2 and Gemma 3 (text), and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (their router loss: ``pipeline.model.moe``). Each runs
the project's attention masks through its HF ``model.model(...)`` forward unchanged (tests/unit/model/test_families.py,
tests/unit/model/test_moe.py); their sliding-window layers are the one thing those masks do not express
(``check_sliding_window``).

Both routes go through ``AutoModelForCausalLM.from_config`` / ``from_pretrained``: under ZeRO-3 (while the trainer
keeps a ``transformers.integrations.HfDeepSpeedConfig`` alive) transformers wraps construction in
``deepspeed.zero.Init`` and still runs its own weight init, so a 7B model never materialises whole on one rank.
A bare ``deepspeed.zero.Init`` around the model class would silently skip that init.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pipeline.export.weights import causal_lm_kwargs
from pipeline.model.moe import num_experts
from pipeline.model.presets import PRESETS, get_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # by the name configs and command lines give

DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


def build_model(spec: str, vocab_size: int, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                pad_token_id: int | None = None, bos_token_id: int | None = None,
                eos_token_id: int | None = None, config: PretrainedConfig | None = None) -> PreTrainedModel:
    """A causal-LM model from a preset name or a local HF checkpoint directory.

    ``vocab_size`` and the special ids come from the data's tokenizer: a preset takes them, a checkpoint must agree
    with them (a model trained on another tokenizer would read the shards' ids as different tokens). ``config``: the
    checkpoint's :func:`start_checkpoint_config`, already read and checked (the trainer's, from preflight).
    """
    if spec in PRESETS:
        config = get_preset(spec).to_config(vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                                            eos_token_id=eos_token_id)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    config = config or start_checkpoint_config(spec, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    config.use_cache = False
    return AutoModelForCausalLM.from_pretrained(Path(spec), config=config, dtype=dtype,
                                                attn_implementation=attn_implementation, local_files_only=True,
                                                **causal_lm_kwargs(spec))


def start_checkpoint_config(spec: str, vocab_size: int, *, bos_token_id: int | None = None,
                            eos_token_id: int | None = None, shape: str = "") -> PretrainedConfig:
    """The config of the HF checkpoint directory ``spec`` (not a preset), read once and checked: of the preset
    ``shape``'s shape when given (``model.shape``, :func:`check_checkpoint_shape`), then against the data
    tokenizer."""
    path = start_dir(spec) if shape else Path(spec)
    if not path.is_dir():
        hint = f"no such directory {spec!r}" if ("/" in spec or spec.startswith(".")) else f"unknown preset {spec!r}"
        raise ValueError(f"{hint}; the model must be one of the presets {', '.join(PRESETS)} "
                         f"or a local HF checkpoint directory (model_type {', '.join(ARCHITECTURES)})")
    config = project_masks(load_checkpoint_config(path))
    if shape:
        check_checkpoint_shape(spec, shape, config)
    check_tokenizer_compatible(config, path, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return config


def project_masks(config: PretrainedConfig) -> PretrainedConfig:
    """HF's causal default back on a loaded config. A bidirectional export says ``is_causal: false`` (so plain
    transformers runs it bidirectionally), which would also turn the project's causal requests (``is_causal=True``
    and no mask, ``pipeline.model.attention``) bidirectional; in the project its own masks decide."""
    config.is_causal = True
    return config


def compiles(setting: bool | str, cuda: bool) -> bool:
    """``model.compile``: ``auto`` compiles on CUDA (per-layer compile is torchtitan's and OLMo-core's default
    there) and not on CPU, where it costs minutes of compile on few cores for little gain."""
    return cuda if setting == "auto" else setting


def compile_body(model: PreTrainedModel) -> None:
    """``torch.compile`` each decoder layer's forward in place (regional compilation: the layers share one compiled
    graph, so compile time does not grow with depth). The layers' own hooks (ZeRO-3's gathers) stay outside the
    compiled code; the embedding, final norm and LM head stay eager. A checkpointed layer (HF checkpoints inside
    ``forward``) compiles with its checkpoint, and its recompute replays no Python side effect: the one dynamo
    finds there is transformers' output-capturing context variable, which a recompute must not replay anyway
    (without the flag the whole layer falls back to eager at that graph break)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward)


def load_checkpoint_config(path: Path) -> PretrainedConfig:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not an HF checkpoint: it has no config.json (expected a save_pretrained "
                         "directory with config.json and model weights)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"{path}/config.json: model_type {config.model_type!r} is not supported; "
                         f"supported architectures: {', '.join(ARCHITECTURES)}")
    return config


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the checkpoint's sliding-window attention layers, None when it has none in use."""
    window = getattr(config, "sliding_window", None)
    return window if window and getattr(config, "use_sliding_window", True) else None


def check_sliding_window(config: PretrainedConfig, spec: str, seq_len: int) -> None:
    """The project's masks have no sliding window: refuse sequences longer than the checkpoint's window, over
    which its sliding-window layers would attend further than they were trained to."""
    window = sliding_window(config)
    if window is not None and seq_len > window:
        raise ValueError(f"{spec}/config.json: sliding_window {window} is shorter than data.seq_len {seq_len}; the "
                         f"project's attention masks have no sliding window, so set data.seq_len <= {window}")


def start_dir(spec: str) -> Path:
    """The start checkpoint directory of continued pretraining, which must exist."""
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"model.init {spec!r}: the start checkpoint does not exist; continued pretraining starts "
                         "from the HF export of a finished run (RUN/hf, written at the end of its training, or "
                         "launch/export_hf.py --run RUN --output DIR); finish or export that run first")
    return path


def check_checkpoint_shape(spec: str, preset: str, config: PretrainedConfig | None = None) -> None:
    """Continued pretraining names the size it continues (``model.shape``): the checkpoint in ``spec`` must have
    that preset's shape, so a run never silently continues the wrong start model. ``config``: the checkpoint's,
    when the caller read it already (:func:`start_checkpoint_config`), else read here."""
    want = get_preset(preset)
    if spec in PRESETS:
        if spec != preset:
            raise ValueError(f"model.init is the preset {spec!r} but model.shape is {preset!r}; make them agree")
        return
    path = Path(spec)
    if config is None:
        config = load_checkpoint_config(start_dir(spec))
    got = (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
           config.num_key_value_heads, num_experts(config))
    expected = (want.num_layers, want.hidden_size, want.ffn_size, want.num_heads, want.num_kv_heads, want.experts)
    if got != expected:
        def shape(s):
            return f"{s[0]} layers, hidden {s[1]}, FFN {s[2]}, {s[3]}/{s[4]} heads" + (f", {s[5]} experts" * bool(s[5]))

        raise ValueError(f"{path}/config.json: the start checkpoint has {shape(got)}, but model.shape {preset!r} "
                         f"has {shape(expected)}; point model.init at a {preset} checkpoint or correct model.shape")


def check_tokenizer_compatible(config: PretrainedConfig, path: Path, vocab_size: int, *,
                               bos_token_id: int | None, eos_token_id: int | None) -> None:
    """Raise when the checkpoint's vocabulary or special ids differ from the data tokenizer's."""
    fix = "tokenize the data with this checkpoint's tokenizer (or pick a checkpoint trained with the data's)"
    if config.vocab_size != vocab_size:
        raise ValueError(f"{path}/config.json: vocab_size {config.vocab_size} does not match the data tokenizer's "
                         f"{vocab_size}; {fix}")
    for name, ours in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        theirs = getattr(config, name, None)
        accepted = theirs if isinstance(theirs, list) else [theirs]
        if ours is not None and theirs is not None and ours not in accepted:
            raise ValueError(f"{path}/config.json: {name} {theirs} differs from the data tokenizer's {ours}; {fix}")
