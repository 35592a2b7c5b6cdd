"""The engine as the trainer builds it, on one CPU rank (gloo, DeepSpeed's CPU accelerator): what ``model.compile``
and bf16 change in ZeRO-3's, and ZeRO-1's BF16 optimizer, checked on the engine itself over a few ``train_step``
calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import warm
from deepspeed.accelerator import get_accelerator
from helpers import REPO, ZERO1, ZERO3, one_rank_env, rendezvous

from pipeline.config import ConfigError
from pipeline.experiment import load_experiment
from pipeline.model.build import build_model, model_spec
from pipeline.planner.estimates import model_states
from pipeline.train.compiling import check_compile
from pipeline.train.ds_config import load_ds_config
from pipeline.train.module import build_device

ZERO1_DEEPCOMPILE = os.path.join(REPO, "ds_configs", "zero1_deepcompile.json")

# Builds the engine from the DeepSpeed JSON argv[3] for the default experiment plus argv[1]'s overrides (bf16 when
# argv[2] == "bf16"), takes 3 CLM steps on one fixed packed batch (two documents in a row: the dense-mask path) and
# prints the losses, dynamo's graph breaks, the optimizer, the dtypes it reduces and accumulates gradients and keeps
# master weights in, and which decoder layers are ZeRO-3 leaf modules.
ENGINE_STEPS = """
import json, os, sys
import deepspeed, torch, torch._dynamo.utils
from pipeline.data.loading.batch import Batch
from pipeline.experiment import load_experiment
from pipeline.tokenizer import load_tokenizer
from pipeline.train.ds_config import load_ds_config, resolve_ds_config
from pipeline.train.engine_spec import engine_spec
from pipeline.train.module import build_engine
from pipeline.train.phases import build_objectives
from pipeline.train.preflight import check_model
from pipeline.train.step import train_step
from deepspeed.utils import z3_leaf_module
cuda = os.environ.get("DS_ACCELERATOR") != "cpu"
deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
exp = load_experiment(None, [*json.loads(sys.argv[1]), f"model.dtype={sys.argv[2]}", "model.attn_implementation=sdpa"])
bf16 = sys.argv[2] == "bf16"
tok = load_tokenizer(exp.data.tokenizer)
objectives = build_objectives(exp.phases[0], tok)
ds = resolve_ds_config(load_ds_config(sys.argv[3]), exp, 1, bf16)
torch.manual_seed(0)
lm, engine = build_engine(ds, check_model(exp, tok, ds, cuda), engine_spec(exp, cuda), [o.objective for o in objectives])
g = torch.Generator().manual_seed(1)
ids = torch.randint(10, tok.info.vocab_size, (2, 48), generator=g)
doc_ids = torch.zeros(2, 48, dtype=torch.int32)
doc_ids[0, 20:] = 1
none = torch.zeros_like(doc_ids)
batch = Batch(input_ids=ids, doc_ids=doc_ids, mask_rank=none, mask_draw=none.long(), span_ids=none - 1,
              keys=["a", "b"]).to(next(engine.module.parameters()).device)
losses = [train_step(engine, objectives, {"packed": [batch]}, 1, 1).losses["clm"] for _ in range(3)]
opt = engine.optimizer
zero3 = type(opt).__name__ == "DeepSpeedZeroOptimizer_Stage3"
grads, master = ((opt.grad_partitions_flat_buffer, opt.fp32_partitioned_groups_flat[0]) if zero3 else
                 (opt.fp32_groups_gradients_flat[0], opt.fp32_groups_flat_partition[0]))
# the BF16 optimizer's model states: flat bf16 weights, fp32 gradients, fp32 master weights, Adam's moments
states = [] if zero3 else (opt.bf16_groups_flat + opt.fp32_groups_gradients_flat + opt.fp32_groups_flat_partition
                           + [t for s in opt.optimizer.state.values() for t in s.values() if t.dim()])
print(json.dumps({"losses": losses, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                  "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "optimizer": type(opt).__name__, "communication": str(engine.communication_data_type),
                  "accumulation": str(grads.dtype), "master": str(master.dtype),
                  "leaf_layers": [z3_leaf_module(layer) for layer in lm.model.layers],
                  "state_bytes": sum(t.numel() * t.element_size() for t in states),
                  "params": sum(getattr(p, "ds_numel", p.numel()) for p in lm.parameters())}), flush=True)
os._exit(0)
"""


def engine_steps(overrides: list[str], dtype: str = "fp32", ds_config: str = ZERO3, cuda: bool = False) -> dict:
    """ENGINE_STEPS on one rank: DeepSpeed's CPU accelerator, or with ``cuda`` the GPU's."""
    args = [json.dumps(["train.micro_batch=2", *overrides]), dtype, ds_config]
    with rendezvous() as rdzv:
        env = one_rank_env(rdzv)
        if cuda:
            del env["DS_ACCELERATOR"]
            proc = subprocess.run([sys.executable, "-c", ENGINE_STEPS, *args], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=900)
        else:  # forked from the warm process (tests/warm.py): the same fresh rank without its imports
            proc = warm.run(code=ENGINE_STEPS, args=args, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_compiled_checkpointed_layers_under_zero3_have_no_graph_breaks_and_train_like_eager():
    """A ZeRO-3 engine of one objective a phase makes the decoder layer a leaf module, so its hooks gather the
    whole layer outside the compiled forward: dynamo compiles each layer, activation checkpointing included (full:
    selective with compile is refused, ``check_compile``), without a break (one per Linear otherwise), and the
    losses equal eager ones (observed within 1e-7 relative; inductor reorders fp32 sums)."""
    eager = engine_steps(["model.compile=false"])
    assert eager["leaf_layers"] == [True, True] and eager["compiled_graphs"] == 0
    compiled = engine_steps(["model.compile=true", "model.activation_checkpointing=true"])
    assert compiled["compiled_graphs"] > 0 and compiled["graph_breaks"] == 0
    for ours, theirs in zip(compiled["losses"], eager["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), (compiled["losses"], eager["losses"])
    assert eager["losses"][2] < eager["losses"][0]  # it trains


@pytest.mark.e2e
def test_bf16_engines_keep_fp32_gradients_and_master_weights(init_dir):
    """DeepSpeed's CPU accelerator trains bf16. ZeRO-3 accumulates the bf16 model's gradients in fp32 (on one rank
    nothing is reduced, so no fp32 copy is made for communication); ds_configs/zero1.json gets DeepSpeed's BF16
    optimizer (fp32 gradients and master weights), which the dtypes show. From the same checkpoint both take the
    same steps (one rank: the same bf16 forward, fp32 gradient sums and AdamW updates of the fp32 master weights):
    bit for bit on a CPU with native bf16 (AVX-512); within 1e-4 relative where oneDNN emulates bf16 GEMMs (AVX2
    alone), whose summation order follows the weights' layout, which ZeRO-3's gathered buffers change (observed:
    1.5e-7 at the 2nd step, 1.2e-5 at the 3rd, as Adam's first steps amplify the gradients' last bits)."""
    start = [f"model.init={init_dir}"]
    zero3 = engine_steps(start, "bf16")
    assert (zero3["communication"], zero3["accumulation"], zero3["master"]) == ("torch.bfloat16",) + ("torch.float32",) * 2
    assert zero3["losses"][2] < zero3["losses"][0]
    zero1 = engine_steps(start, "bf16", ZERO1)
    assert (zero1["optimizer"], zero1["accumulation"], zero1["master"]) == ("BF16_Optimizer",) + ("torch.float32",) * 2
    assert zero1["leaf_layers"] == [False, False]  # leaf modules are ZeRO-3's only
    assert zero1["losses"] == pytest.approx(zero3["losses"], rel=1e-4, abs=0)
    planned = model_states(zero1["params"], 0, 1, False, 1, 1).gpu  # the planner's ZeRO-1: 18 B/param on one GPU
    assert zero1["state_bytes"] == pytest.approx(planned, rel=1e-3)  # (flat buffers pad to an aligned size)


def test_models_below_zero3_are_built_on_the_engines_device():
    """Under ZeRO 0-2 the model is built inside the engine's device context (zero.Init places ZeRO-3's partitions),
    and HF's construction honours such a context: built under the meta device, no weight is made on the host."""
    assert build_device({"zero_optimization": {"stage": 3}}) is None
    assert build_device({"zero_optimization": {"stage": 1}}) == torch.device(get_accelerator().current_device_name())
    with torch.device("meta"):
        model = build_model(model_spec("tiny", 64))
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message DeepCompile gives without CUDA")
def test_deepcompile_without_cuda_is_a_config_error():
    """DeepSpeed 0.19.7 builds DeepCompile's op against CUDA headers (on CPU: "cuda.h: No such file"), so a CPU run
    that asks for it stops first with one line naming the field."""
    with pytest.raises(ConfigError, match="compile.deepcompile needs CUDA"):
        check_compile(load_experiment(None), load_ds_config(ZERO1_DEEPCOMPILE))
    check_compile(load_experiment(None), load_ds_config(ZERO1))  # the plain engine


@pytest.mark.e2e
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepCompile runs on CUDA only (DeepSpeed 0.19.8)")
def test_deepcompile_engine_trains_like_the_plain_one():
    """ds_configs/zero1_deepcompile.json: the engine compiles the whole module with DeepSpeed's passes, and its
    bf16 losses over 3 steps stay within 1e-2 relative of the plain ZeRO-1 engine's (inductor reorders bf16 sums)."""
    plain = engine_steps([], "bf16", ZERO1, cuda=True)
    compiled = engine_steps([], "bf16", ZERO1_DEEPCOMPILE, cuda=True)
    for ours, theirs in zip(compiled["losses"], plain["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-2 * abs(theirs), (compiled["losses"], plain["losses"])
