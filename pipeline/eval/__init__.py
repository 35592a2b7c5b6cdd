"""Evaluation: one command from a checkpoint to the papers' numbers (``launch/evaluate.py``), the embedding API, and
the ablation report (``launch/report.py``). See docs/evaluation.md.

- ``load_model(path)``: a run directory or HF directory, with its tokenizer and how its training says to read it;
- ``encode(model, texts, instruction=None, pooling=None, layout=None, dim=None)`` (defaults: the model's training
  record); ``pipeline.eval.mteb_encoder.MTEBEncoder`` for MTEB 2.x (imports mteb, so not imported here);
- ``registry.TASKS``: every task by name, one module per family.
"""

from pipeline.eval.encode import encode
from pipeline.eval.load import EvalModel, load_model

__all__ = ["EvalModel", "encode", "load_model"]
