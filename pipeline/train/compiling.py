"""How the model compiles, decided in preflight (:func:`check_compile`, :func:`body_compiles`) from the experiment
and the resolved DeepSpeed config: DeepCompile (the engine compiles the whole module) or each decoder layer
(``model.compile``), and whether the decoder layers may be ZeRO-3 leaf modules (:func:`leaf_layers`), which the
engine's spec carries (``pipeline.train.engine_spec``). DeepSpeed is imported only where DeepCompile is asked
for, so preflight stays light."""

from __future__ import annotations

import sys

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig
from pipeline.model.build import compiles
from pipeline.model.checkpointing import SELECTIVE


def deepcompile(ds: dict) -> bool:
    """Whether the DeepSpeed config asks for DeepCompile (``"compile": {"deepcompile": true}``), DeepSpeed's
    compiler path: its own graph passes schedule ZeRO's gathers and reductions, and the engine compiles the
    whole module (``pipeline.train.module.build_engine``), so the per-layer ``model.compile`` stays off."""
    return bool(ds.get("compile", {}).get("deepcompile"))


FP32_NAMES = ("fp32", "float32", "float")  # DeepSpeed's DtypeEnum names of fp32


def check_compile(exp: ExperimentConfig, ds: dict) -> None:
    """Compile settings that cannot run, refused before the engine is built: DeepCompile at ZeRO-1 with bf16 weights
    and fp32 gradient accumulation (DeepSpeed 0.19.8 then picks its ``BF16_Optimizer``, and DeepCompile's ZeRO-1/2
    pass, ``deepspeed/compile/init_z1_and_2.py``, reads ``bit16_groups`` / ``first_offset`` /
    ``params_in_partition``, which only its ZeRO optimizer has); DeepCompile without CUDA (its passes and native ops
    are CUDA-only); DeepCompile with ``model.compile: true`` (it compiles the whole module itself); and selective
    activation checkpointing with ``model.compile: true`` (:func:`body_compiles`)."""
    if exp.model.compile is True and exp.model.activation_checkpointing == SELECTIVE and not deepcompile(ds):
        raise ConfigError("model.compile: true with model.activation_checkpointing: selective: transformers "
                          "checkpoints each layer outside its compiled forward, so the selective policy never sees "
                          "the compiled matmuls and recomputes everything; use activation_checkpointing: true, or "
                          "model.compile: false (auto does not compile a selectively checkpointed model)")
    if not deepcompile(ds):
        return
    from deepspeed.compile.util import is_deepcompile_supported

    zero = ds.get("zero_optimization", {})
    fp32_accum = str(ds.get("data_types", {}).get("grad_accum_dtype", "")).lower() in FP32_NAMES
    if zero.get("stage") == 1 and ds.get("bf16", {}).get("enabled") is True and fp32_accum:
        raise ConfigError("DeepSpeed config: compile.deepcompile at zero_optimization.stage 1 with bf16 and "
                          "data_types.grad_accum_dtype fp32 makes DeepSpeed use its BF16_Optimizer, which DeepCompile's "
                          "ZeRO-1 pass cannot drive; set \"data_types\": {\"grad_accum_dtype\": \"bf16\"} (as "
                          "ds_configs/zero1_deepcompile.json does) or use stage 2")
    if not is_deepcompile_supported():
        raise ConfigError("DeepSpeed config: compile.deepcompile needs CUDA (DeepSpeed's DeepCompile has no CPU "
                          "path); remove the \"compile\" section or use ds_configs/zero1.json here")
    if exp.model.compile is True:
        raise ConfigError("model.compile: true compiles each decoder layer, but the DeepSpeed config's "
                          "compile.deepcompile compiles the whole module; set model.compile=auto (or false)")


def body_compiles(exp: ExperimentConfig, ds: dict, cuda: bool) -> bool:
    """Whether each decoder layer is compiled (``model.compile``, :func:`pipeline.model.build.compiles`). Never under
    DeepCompile (it compiles the whole module). ``auto`` also leaves eager: a selectively checkpointed model
    (transformers 5.17, the GPU's, checkpoints in ``GradientCheckpointingLayer.__call__``, outside the compiled
    ``forward``, so the policy's dispatch mode sees no ``aten.mm`` and keeps nothing; later versions checkpoint
    inside ``forward``, but the rule is the same on every version, so a config means one thing) and a ZeRO-3 model whose layers cannot be leaf
    modules (:func:`leaf_layers`: LoRA, several objectives a phase), where DeepSpeed's compiler-disabled
    per-module hooks sit inside every compiled layer, a graph break at each of them. ``true`` compiles the
    latter anyway, with a note of that cost."""
    if deepcompile(ds) or not compiles(exp.model.compile, cuda):
        return False
    stage3 = ds.get("zero_optimization", {}).get("stage") == 3
    if exp.model.compile == "auto":
        return exp.model.activation_checkpointing != SELECTIVE and not (stage3 and not leaf_layers(exp))
    if stage3 and not leaf_layers(exp):
        print("note: model.compile: true under ZeRO-3 with LoRA or several objectives a phase: DeepSpeed's per-module "
              "hooks break each compiled layer into several graphs (model.compile: auto leaves it eager)",
              file=sys.stderr, flush=True)
    return True


def leaf_layers(exp: ExperimentConfig) -> bool:
    """Whether the decoder layers may be ZeRO-3 leaf modules. DeepSpeed reduces a leaf module's gradients in its
    backward hook, which runs once per forward call, so each micro-step must run a layer once before its backward:
    a phase of several objectives sums their losses into one backward after one body forward each (DeepSpeed 0.19
    then asserts on a parameter reduced twice: MAGNET + SSCL, tests/e2e/test_magnet_train.py). And a LoRA layer, whose
    frozen weights take no gradient, reaches its backward with them still partitioned (a size-0 weight in the
    input's gradient: tests/unit/model/test_lora.py). Those runs keep the per-module hooks. Every objective runs the body once
    a call (SimCSE its two views in one batch)."""
    return all(len(phase.objectives) == 1 for phase in exp.phases) and not exp.model.lora.r
