"""``model.compile``: the compiled decoder body trains like the eager one (same losses, step after step)."""

from __future__ import annotations

import torch
import torch._dynamo.utils

from pipeline.data.batch import Batch
from pipeline.model.build import build_model, compile_body
from pipeline.objectives import CLM, MLM, CLMConfig, Masking, MLMConfig


def test_compiled_body_gives_the_eager_losses():
    """Two copies of a tiny Llama, one with compiled layers, take the same AdamW steps on packed rows (document
    masking: the dense-mask path) alternating CLM and MLM; their losses agree at every step."""
    torch.manual_seed(0)
    eager = build_model("tiny", 64)
    compiled = build_model("tiny", 64)
    compiled.load_state_dict(eager.state_dict())
    compile_body(compiled)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 64, (2, 32), generator=g)
    doc_ids = torch.zeros(2, 32, dtype=torch.int32)
    doc_ids[0, 12:] = 1
    batch = Batch(input_ids=input_ids, doc_ids=doc_ids, mask_rank=torch.stack([torch.randperm(32, generator=g)
                                                                                for _ in range(2)]).int(),
                  mask_draw=torch.randint(0, 1 << 30, (2, 32), generator=g), span_ids=torch.full_like(doc_ids, -1),
                  keys=["a", "b"])
    objectives = [CLM(CLMConfig()), MLM(MLMConfig(), Masking(0.3, "80-10-10", mask_id=3, random_pool=torch.arange(4, 64)))]
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)}
    for step in range(4):
        losses = {}
        for model, optimizer in optimizers.items():
            optimizer.zero_grad()
            objective = objectives[step % 2]
            out = objective(model, batch)[objective.name]
            out.loss_sum.backward()
            optimizer.step()
            losses[model is compiled] = out.loss_sum.item()
        assert abs(losses[True] - losses[False]) <= 1e-4 * abs(losses[False]), (step, losses)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the layers did run compiled
