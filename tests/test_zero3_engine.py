"""The ZeRO-3 engine as the trainer builds it, on one CPU rank (gloo, DeepSpeed's CPU accelerator): what
``model.compile`` and bf16 change in it, checked on the engine itself over a few ``train_step`` calls."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, ZERO3, one_rank_env, rendezvous

# Builds the engine from ds_configs/zero3.json for the default experiment plus argv[1]'s overrides (bf16 when
# argv[2] == "bf16"), takes 3 CLM steps on one fixed packed batch (two documents in a row: the dense-mask path) and
# prints the losses, dynamo's graph breaks, and the dtypes ZeRO-3 reduces and accumulates gradients in.
ENGINE_STEPS = """
import json, os, sys
import deepspeed, torch, torch._dynamo.utils
from pipeline.data.batch import Batch
from pipeline.experiment import load_experiment
from pipeline.tokenizer import load_tokenizer
from pipeline.train.ds_config import load_ds_config, resolve_ds_config
from pipeline.train.module import build_engine
from pipeline.train.phases import build_objectives
from pipeline.train.step import train_step
deepspeed.init_distributed(dist_backend="gloo")
exp = load_experiment(None, json.loads(sys.argv[1]))
bf16 = sys.argv[2] == "bf16"
tok = load_tokenizer(exp.data.tokenizer)
objectives = build_objectives(exp.phases[0], tok)
ds = resolve_ds_config(load_ds_config(sys.argv[3]), exp, 1, bf16)
torch.manual_seed(0)
_, engine = build_engine(exp, ds, tok, bf16, [o.objective for o in objectives], attn_implementation="sdpa",
                         fused="none")
g = torch.Generator().manual_seed(1)
ids = torch.randint(10, tok.info.vocab_size, (2, 48), generator=g)
doc_ids = torch.zeros(2, 48, dtype=torch.int32)
doc_ids[0, 20:] = 1
none = torch.zeros_like(doc_ids)
batch = Batch(input_ids=ids, doc_ids=doc_ids, mask_rank=none, mask_draw=none.long(), span_ids=none - 1, keys=["a", "b"])
losses = [train_step(engine, objectives, {"packed": [batch]}, 1, 1).losses["clm"] for _ in range(3)]
zero = engine.optimizer
print(json.dumps({"losses": losses, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                  "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "communication": str(zero.communication_data_type),
                  "accumulation": str(zero.grad_partitions_flat_buffer.dtype)}), flush=True)
os._exit(0)
"""


def engine_steps(overrides: list[str], dtype: str = "fp32") -> dict:
    with rendezvous() as rdzv:
        proc = subprocess.run([sys.executable, "-c", ENGINE_STEPS, json.dumps(["train.micro_batch=2", *overrides]),
                               dtype, ZERO3], env=one_rank_env(rdzv), cwd=REPO, capture_output=True, text=True,
                              timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_compiled_layers_under_zero3_have_no_graph_breaks_and_train_like_eager():
    """With the decoder layer a ZeRO-3 leaf module, its hooks gather the whole layer outside the compiled forward:
    dynamo compiles each layer without a break (one per Linear otherwise), and the losses equal eager ones."""
    eager = engine_steps([])
    compiled = engine_steps(["model.compile=true"])
    assert compiled["compiled_graphs"] > 0 and compiled["graph_breaks"] == 0
    for ours, theirs in zip(compiled["losses"], eager["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), (compiled["losses"], eager["losses"])
    assert eager["losses"][2] < eager["losses"][0]  # it trains


@pytest.mark.e2e
def test_bf16_zero3_engine_reduces_and_accumulates_gradients_in_fp32():
    """DeepSpeed's CPU accelerator trains bf16: the resolved config makes ZeRO-3 reduce-scatter and accumulate the
    bf16 model's gradients in fp32, and the run starts and learns."""
    result = engine_steps([], "bf16")
    assert (result["communication"], result["accumulation"]) == ("torch.float32", "torch.float32")
    assert result["losses"][2] < result["losses"][0]
