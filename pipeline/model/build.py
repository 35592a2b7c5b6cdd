"""Build the model: a preset trained from scratch, or a local HF decoder checkpoint for continued pretraining.

:func:`build_model` is the one builder: it takes a :class:`ModelSpec` (what preflight decided: the config, the
weights, dtype and attention, LoRA, attention dropout, the chunked head, checkpointing and compile) and returns the
finished module; the trainer's engine (``pipeline.train.module.build_engine``) adds only what training needs
around it (ZeRO-3's construction context, the objectives' heads, leaf layers, the optimizer).

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

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pipeline.model.checkpointing import enable_checkpointing
from pipeline.model.lm_head import chunk_lm_head
from pipeline.model.load_hf import load_hf, project_masks
from pipeline.model.lora import add_lora
from pipeline.model.moe import num_experts
from pipeline.model.presets import PRESETS, get_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # by the name configs and command lines give

DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


@dataclass(frozen=True)
class ModelSpec:
    """Everything the model is built from, decided once (the trainer's preflight,
    ``pipeline.train.preflight.model_spec``): :func:`build_model` reads it and checks nothing. ``config`` is lent:
    the builder works on a copy, so the spec stays as it was decided."""

    config: PretrainedConfig  # a preset's (:func:`preset_config`) or a checkpoint's (:func:`start_checkpoint_config`)
    checkpoint: str | None = None  # the HF directory whose weights are loaded (None: a preset's fresh weights)
    dtype: torch.dtype = torch.float32
    attn_implementation: str = "sdpa"
    lora_r: int = 0  # model.lora: rank (0: no adapter), alpha, dropout, target modules
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    attention_dropout: float | None = None  # set on every attention layer (None: the config's)
    lm_head_chunk: int = 0  # model.lm_head_chunk (0: the plain head)
    activation_checkpointing: bool | str | int = False  # model.activation_checkpointing
    compile: bool = False  # each decoder layer's forward compiled (:func:`compile_body`)


def preset_config(name: str, vocab_size: int, *, pad_token_id: int | None = None, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> PretrainedConfig:
    """The preset ``name``'s HF config with the data tokenizer's vocabulary size and special ids."""
    return get_preset(name).to_config(vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                                      eos_token_id=eos_token_id)


def model_spec(init: str, vocab_size: int, *, pad_token_id: int | None = None, bos_token_id: int | None = None,
               eos_token_id: int | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa") -> ModelSpec:
    """The spec of a bare model (no adapter, checkpointing or compile) of a preset or a local checkpoint directory
    ``init``, whose config is read and checked here (:func:`start_checkpoint_config`): the tools' and tests' model.
    The trainer's spec comes from its preflight, which reads the config once."""
    if init in PRESETS:
        return ModelSpec(preset_config(init, vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                                       eos_token_id=eos_token_id), dtype=dtype, attn_implementation=attn_implementation)
    config = start_checkpoint_config(init, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return ModelSpec(config, init, dtype, attn_implementation)


def build_model(spec: ModelSpec, device: torch.device | None = None) -> PreTrainedModel:
    """The finished model of ``spec``: created (a preset) or loaded (a checkpoint, in eval mode as HF loads it), on
    ``device`` when given, the LoRA adapter injected, the attention dropout set, the LM head chunked, the layers
    checkpointed and compiled."""
    config = copy.deepcopy(spec.config)  # lent: HF and the steps below set fields on the model's config
    with device or contextlib.nullcontext():
        if spec.checkpoint is None:
            lm = AutoModelForCausalLM.from_config(config, dtype=spec.dtype,
                                                  attn_implementation=spec.attn_implementation)
        else:
            config.use_cache = False
            lm = load_hf(Path(spec.checkpoint), dtype=spec.dtype, attn_implementation=spec.attn_implementation,
                         config=config)
    if spec.lora_r:
        add_lora(lm, spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.lora_targets)
    lm.config.use_cache = False
    if spec.attention_dropout is not None:
        lm.config.attention_dropout = spec.attention_dropout
        for module in lm.modules():  # each attention layer copied the value from the config when it was built
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = spec.attention_dropout
    if spec.lm_head_chunk:
        chunk_lm_head(lm, spec.lm_head_chunk)
    enable_checkpointing(lm, spec.activation_checkpointing)
    if spec.compile:
        compile_body(lm)
    return lm


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


def compiles(setting: bool | str, cuda: bool) -> bool:
    """``model.compile``: ``auto`` compiles on CUDA (per-layer compile is torchtitan's and OLMo-core's default
    there) and not on CPU, where it costs minutes of compile on few cores for little gain."""
    return cuda if setting == "auto" else setting


def compile_body(model: PreTrainedModel) -> None:
    """``torch.compile`` each decoder layer's forward in place (regional compilation: the layers share one compiled
    graph, so compile time does not grow with depth). The layers' own hooks (ZeRO-3's gathers) stay outside the
    compiled code; the embedding, final norm and LM head stay eager. A checkpointed layer compiles with its
    checkpoint (transformers 5.25, this venv's, wraps ``forward`` in it) or runs its compiled forward inside it (5.17: the
    checkpoint is in ``GradientCheckpointingLayer.__call__``), and its recompute replays no Python side effect: the one dynamo finds there is transformers' output-capturing
    context variable, which a recompute must not replay anyway (without the flag the whole layer falls back to eager
    at that graph break). Selective checkpointing's policy cannot see inside the compiled forward, so the trainer
    does not compile it (``pipeline.train.module.body_compiles``)."""
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


def check_checkpoint_shape(spec: str, preset: str, config: PretrainedConfig) -> None:
    """Continued pretraining names the size it continues (``model.shape``): the checkpoint in ``spec`` (its
    ``config``, as :func:`start_checkpoint_config` read it) must have that preset's shape, so a run never silently
    continues the wrong start model; a preset ``spec`` must be that preset."""
    want = get_preset(preset)
    if spec in PRESETS:
        if spec != preset:
            raise ValueError(f"model.shape: {preset!r}, but model.init is the preset {spec!r}; set model.shape={spec} "
                             f"(or \"\": unchecked), or model.init to a checkpoint of {preset}'s shape")
        return
    path = Path(spec)
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
