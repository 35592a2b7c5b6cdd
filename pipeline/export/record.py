"""The training record an HF export keeps in its ``config.json``, so an encoder stays an encoder outside the run.

Two entries are written next to the architecture's own fields:

- ``is_causal``: transformers' own switch (``masking_utils.create_causal_mask`` builds a bidirectional mask when
  it is false), so ``AutoModel.from_pretrained(DIR)`` runs a bidirectionally trained model bidirectionally with
  transformers alone: no remote code, no project import.
- ``decoder_encoders``: the ``EncoderRecord`` below (attention, whether token i is read at i - 1, mask token,
  pooling, layout, instruction, objectives, Matryoshka dims), which ``pipeline.eval.load_model`` reads instead of
  the run directory. Its Matryoshka fields are written only when set, so exports without them keep their bytes.

The project itself passes every attention mask explicitly and gives a loaded config HF's causal default back
(``pipeline.model.load_hf.project_masks``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from transformers import PretrainedConfig

from pipeline.data.format.instructions import LAYOUTS
from pipeline.experiment import ExperimentConfig
from pipeline.objectives import OBJECTIVES, ObjectiveConfig
from pipeline.objectives.configs import Reading
from pipeline.tokenizer import Tokenizer

KEY = "decoder_encoders"
ATTENTIONS = ("causal", "bidirectional")
POOLINGS = ("mean", "last", "weighted_mean")
WRITTEN_WHEN_SET = ("matryoshka_dims", "truncate_dim")  # newer fields: left out unset, older exports' bytes kept


@dataclass(frozen=True)
class EncoderRecord:
    attention: str = "causal"  # how encoders read text: bidirectional when the last phase trained a non-causal objective
    reads_previous: bool = False  # MNTP-trained: token i is read (and predicted) at position i - 1
    mask_token: str | None = None  # the token MLM/MNTP masked with, as written in the vocabulary
    pooling: str = "mean"  # default pooling of encode() and of the sentence-transformers export
    layout: str = "bos_eos"  # default layout of encode() (LAYOUTS)
    instruction: str | None = None  # default instruction (SSCL trains with one), left out of pooling
    # how an instruction becomes the prefix of a query, e.g. "{instruction}: " (supervised training joined its
    # task instructions so); None: instructions are verbatim prefixes
    instruction_format: str | None = None
    objectives: tuple[str, ...] = ()  # per phase, e.g. ("clm", "mlm"); empty for a model not trained here
    matryoshka_dims: tuple[int, ...] = ()  # the leading dims the last phase trained to stand alone (Matryoshka)
    truncate_dim: int | None = None  # the dims encode() keeps by default (sentence-transformers' truncate_dim)

    def __post_init__(self) -> None:
        for name, value, allowed in (("attention", self.attention, ATTENTIONS), ("pooling", self.pooling, POOLINGS),
                                     ("layout", self.layout, LAYOUTS)):
            if value not in allowed:
                raise ValueError(f"{KEY}.{name}: {value!r} is not one of {', '.join(allowed)}")
        if self.truncate_dim is not None and self.truncate_dim < 1:
            raise ValueError(f"{KEY}.truncate_dim: {self.truncate_dim} is not a positive number of dims")

    def as_dict(self) -> dict:
        out = {**asdict(self), "objectives": list(self.objectives), "matryoshka_dims": list(self.matryoshka_dims)}
        return {k: v for k, v in out.items() if v or k not in WRITTEN_WHEN_SET}

    @classmethod
    def from_dict(cls, raw: dict) -> EncoderRecord:
        """The record of :meth:`as_dict`'s JSON (lists back to tuples)."""
        return cls(**{**raw, "objectives": tuple(raw.get("objectives", ())),
                      "matryoshka_dims": tuple(raw.get("matryoshka_dims", ()))})


def start_record(init: str) -> EncoderRecord | None:
    """The record of a run's start checkpoint (``model.init``) when it is an export with one."""
    path = os.path.join(init, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return read_record(json.load(f))


def last_reading(objectives: list[ObjectiveConfig]) -> Reading:
    """How the last phase's ``objectives`` read text, as each declares (``ObjectiveConfig.reading``): a pooling
    other than the mean wins over the mean (SSCL's last token beside SimCSE); an instruction whose objective
    formats it (supervised's task instructions) wins over a verbatim one (SSCL's); mean pooling, no instruction
    when none declares one (CLM, MLM, MNTP, MAGNET)."""
    readings = [r for o in objectives if (r := o.reading()) is not None]
    pooling = next((r.pooling for r in readings if r.pooling != "mean"), "mean")
    told = next((r for r in readings if r.instruction_format is not None),
                next((r for r in readings if r.instruction is not None), Reading(pooling)))
    return Reading(pooling, told.instruction, told.instruction_format)


def from_experiment(exp: ExperimentConfig, tokenizer: Tokenizer) -> EncoderRecord:
    """The record of a run from its typed experiment and its tokenizer: the objectives' own configs decide (the
    mask token, SSCL's instruction); a run that continues an export (SimCSE after MNTP) keeps that export's
    ``reads_previous`` and mask token."""
    start = start_record(exp.model.init) or EncoderRecord()
    last = exp.phases[-1].objectives
    trained = [o for p in exp.phases for o in p.objectives]
    masked = [o for o in trained if OBJECTIVES[o.name].masks]
    mask_token = masked[-1].mask_token if masked else start.mask_token
    if masked and mask_token is None and tokenizer.mask_id is not None:
        mask_token = tokenizer.hf.convert_ids_to_tokens(tokenizer.mask_id)
    reading = last_reading(last)
    nested = next((m for o in last if (m := o.nesting())), None)
    return EncoderRecord(attention="causal" if all(OBJECTIVES[o.name].causal for o in last) else "bidirectional",
                         reads_previous=start.reads_previous or any(OBJECTIVES[o.name].masks
                                                                    and OBJECTIVES[o.name].predicts_next
                                                                    for o in trained),
                         mask_token=mask_token, pooling=reading.pooling, layout="bos_eos",
                         instruction=reading.instruction, instruction_format=reading.instruction_format,
                         objectives=start.objectives + tuple("+".join(o.name for o in p.objectives) for p in exp.phases),
                         matryoshka_dims=nested.dims if nested else ())


def read_record(config: PretrainedConfig | dict) -> EncoderRecord | None:
    """The record of a loaded config (or a config.json dict); None for a model exported without one."""
    raw = config.get(KEY) if isinstance(config, dict) else getattr(config, KEY, None)
    if raw is None:
        return None
    known = {f.name for f in fields(EncoderRecord)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"config.json: {KEY} has unknown fields {sorted(unknown)}; known: {', '.join(sorted(known))}")
    return EncoderRecord.from_dict(raw)


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

