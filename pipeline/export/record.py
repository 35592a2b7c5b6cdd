"""The training record an HF export keeps in its ``config.json``, so an encoder stays an encoder outside the run.

Two entries are written next to the architecture's own fields:

- ``is_causal``: transformers' own switch (``masking_utils.create_causal_mask`` builds a bidirectional mask when
  it is false), so ``AutoModel.from_pretrained(DIR)`` runs a bidirectionally trained model bidirectionally with
  transformers alone: no remote code, no project import.
- ``decoder_encoders``: the ``EncoderRecord`` below (attention, whether token i is read at i - 1, mask token,
  pooling, layout, instruction, objectives), which ``pipeline.eval.load_model`` reads instead of the run directory.

The project itself passes every attention mask explicitly and gives a loaded config HF's causal default back
(``pipeline.model.build.project_masks``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from transformers import PretrainedConfig

from pipeline.objectives import OBJECTIVES
from pipeline.objectives.sscl import INSTRUCTION as SSCL_INSTRUCTION
from pipeline.tokenizer import Tokenizer

KEY = "decoder_encoders"
ATTENTIONS = ("causal", "bidirectional")
POOLINGS = ("mean", "last", "weighted_mean")
# how encode() lays a text out: data prep's BOS text EOS; the tokenizer's own special tokens (what
# ``tokenizer(text)`` adds: LLM2Vec's and sentence-transformers' layout); the text tokens alone
LAYOUTS = ("bos_eos", "special", "text")


@dataclass(frozen=True)
class EncoderRecord:
    attention: str = "causal"  # how encoders read text: bidirectional when the last phase trained a non-causal objective
    reads_previous: bool = False  # MNTP-trained: token i is read (and predicted) at position i - 1
    mask_token: str | None = None  # the token MLM/MNTP masked with, as written in the vocabulary
    pooling: str = "mean"  # default pooling of encode() and of the sentence-transformers export
    layout: str = "bos_eos"  # default layout of encode() (LAYOUTS)
    instruction: str | None = None  # default instruction (SSCL trains with one), left out of pooling
    objectives: tuple[str, ...] = ()  # per phase, e.g. ("clm", "mlm"); empty for a model not trained here

    def __post_init__(self) -> None:
        for name, value, allowed in (("attention", self.attention, ATTENTIONS), ("pooling", self.pooling, POOLINGS),
                                     ("layout", self.layout, LAYOUTS)):
            if value not in allowed:
                raise ValueError(f"{KEY}.{name}: {value!r} is not one of {', '.join(allowed)}")

    def as_dict(self) -> dict:
        return {**asdict(self), "objectives": list(self.objectives)}


def _phase_objectives(experiment: dict) -> list[list[dict]]:
    return [p.get("objectives", []) for p in experiment.get("phases", [])]


def start_record(experiment: dict) -> EncoderRecord | None:
    """The record of the run's start checkpoint (``model.init``) when it is an export with one."""
    path = os.path.join(str(experiment.get("model", {}).get("init", "")), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return read_record(json.load(f))


def from_experiment(experiment: dict, tokenizer: Tokenizer) -> EncoderRecord:
    """The record of a run from its ``experiment.json`` (or ``to_dict`` of its config) and its tokenizer; a run
    that continues an export (SimCSE after MNTP) keeps that export's ``reads_previous`` and mask token."""
    start = start_record(experiment) or EncoderRecord()
    phases = _phase_objectives(experiment)
    last = [o["name"] for o in phases[-1]] if phases else []
    trained = [(o, OBJECTIVES[o["name"]]) for p in phases for o in p if o["name"] in OBJECTIVES]
    masked = [o for o, cls in trained if cls.masks]
    mask_token = masked[-1].get("mask_token") if masked else start.mask_token
    if masked and mask_token is None and tokenizer.mask_id is not None:
        mask_token = tokenizer.hf.convert_ids_to_tokens(tokenizer.mask_id)
    sscl = "sscl" in last
    causal = all(OBJECTIVES[n].causal for n in last if n in OBJECTIVES)
    return EncoderRecord(attention="causal" if causal else "bidirectional",
                         reads_previous=start.reads_previous or any(cls.masks and cls.predicts_next
                                                                    for _, cls in trained),
                         mask_token=mask_token, pooling="last" if sscl else "mean", layout="bos_eos",
                         instruction=SSCL_INSTRUCTION if sscl else None,
                         objectives=start.objectives + tuple("+".join(o["name"] for o in p) for p in phases))


def read_record(config: PretrainedConfig | dict) -> EncoderRecord | None:
    """The record of a loaded config (or a config.json dict); None for a model exported without one."""
    raw = config.get(KEY) if isinstance(config, dict) else getattr(config, KEY, None)
    if raw is None:
        return None
    known = {f.name for f in fields(EncoderRecord)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"config.json: {KEY} has unknown fields {sorted(unknown)}; known: {', '.join(sorted(known))}")
    return EncoderRecord(**{**raw, "objectives": tuple(raw.get("objectives", ()))})


def write_record(hf_dir: str, record: EncoderRecord) -> None:
    """Add the record and transformers' ``is_causal`` switch to ``hf_dir/config.json``."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["is_causal"] = record.attention == "causal"
    config[KEY] = record.as_dict()
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

