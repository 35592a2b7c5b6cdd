"""``model.activation_checkpointing``: every mode gives the plain path's loss and gradients, and the selective
policy keeps per layer what the planner counts."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from pipeline.config import ConfigError
from pipeline.experiment import load_experiment
from pipeline.model.build import build_model, compiles, model_spec
from pipeline.model.checkpointing import enable_checkpointing, selective_contexts, selective_layer_bytes


def loss_and_gradients(setting) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One CLM forward and backward of the seeded tiny preset on a fixed batch, checkpointed as ``setting`` says."""
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64))
    enable_checkpointing(model, setting)
    ids = torch.randint(4, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpointing_modes_give_the_plain_gradients():
    """Full, every-2nd-layer and selective checkpointing recompute the same CPU kernels on the same inputs, so the
    loss and every gradient equal the plain backward's bit for bit."""
    loss, grads = loss_and_gradients(False)
    for setting in (True, 2, "selective"):
        ours, our_grads = loss_and_gradients(setting)
        assert torch.equal(ours, loss), setting
        assert all(torch.equal(our_grads[n], g) for n, g in grads.items()), setting


def test_every_kth_layer_is_checkpointed():
    model = build_model(model_spec("tiny", 64))
    enable_checkpointing(model, 2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_selective_checkpointing_keeps_what_the_planner_counts():
    """The bytes the selective policy stores per token and layer (bf16: the kept matmul outputs, attention's output
    and log-sum-exp), plus the layer input the checkpoint keeps, are the planner's ``selective_layer_bytes``."""
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64, dtype=torch.bfloat16))
    caching = []

    def contexts():
        forward, recompute = selective_contexts()
        caching.append(forward)
        return forward, recompute

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": contexts})
    ids = torch.randint(4, 64, (2, 32))
    model.model(input_ids=ids)
    # each op's outputs, by call: a tree of _VersionWrapper(tensor) when kept, a sentinel when recomputed (torch
    # 2.13 keys each op's calls by their index, 2.11 lists them)
    kept = [w.val for mode in caching for outputs in mode.storage.values()
            for out in (outputs.values() if isinstance(outputs, dict) else outputs)
            for w in pytree.tree_leaves(out, is_leaf=lambda x: hasattr(x, "val")) if hasattr(w, "val")]
    per_token = sum(t.numel() * t.element_size() for t in kept if isinstance(t, torch.Tensor)) / ids.numel()
    assert len(caching) == model.config.num_hidden_layers
    assert per_token / len(caching) + 2 * model.config.hidden_size == selective_layer_bytes(model.config)


def test_compile_and_checkpointing_settings():
    assert (compiles("auto", True), compiles("auto", False), compiles(True, False), compiles(False, True)) == (
        True, False, True, False)
    assert load_experiment(None).model.compile == "auto"
    assert load_experiment(None, ["model.activation_checkpointing=selective"]).model.activation_checkpointing == \
        "selective"
    with pytest.raises(ConfigError, match="model.activation_checkpointing: 0 layers"):
        load_experiment(None, ["model.activation_checkpointing=0"])
