"""What a scale reads and builds before training (``prepare_inputs``): the real data extracted, SmolLM2 imported
where a study reads it, the unit, span and pairs shards its runs read that the trainer does not build; and what a
bare machine must be given (``inputs``)."""

from __future__ import annotations

import glob
import os

from pipeline.data.format.index import MANIFEST
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.io import REPO
from pipeline.model.gguf_import import import_gguf, packaged_gguf
from pipeline.reproduce.data import extract, is_extracted
from pipeline.reproduce.invocation import Reproduction, variants
from pipeline.reproduce.stages import Stages
from pipeline.reproduce.studies import SMOLLM2

REAL = "runs/real"
DOWNLOADS = "runs/downloads"
UNIT_SHARDS = "runs/reproduce/shards/smollm2-reviews-units-{seq_len}"  # sentence units: SimCSE, MAGNET's SSCL
SPAN_SHARDS = "runs/reproduce/shards/smollm2-reviews-spans-{seq_len}"  # packed, with MAGNET spans (trainer: none)
# what experiments/reproduce/*/grid.yaml (the CPU scales) and paper.yaml read: CPU SimCSE on units cut to 32
# tokens (Wiki1M's sentences are ~25), half the cost of 64 a step
UNIT_SEQ_LEN = {"quick": 32, "full": 32, "paper": 64}
SPAN_SEQ_LEN = {"quick": 128, "full": 128, "paper": 512}
PAIR_SHARDS = "runs/reproduce/shards/smollm2-pairs-64"  # LLM2Vec's supervised stage: 3 texts of <= 64 tokens a row


def size_mb(path: str) -> float:
    """Bytes of a file, or of every file under a directory, in MB (10^6)."""
    if os.path.isfile(path):
        return os.path.getsize(path) / 1e6
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


def reads_smollm2(r: Reproduction) -> bool:
    """Whether a selected study reads SmolLM2: a baseline, or a run that starts from it or uses its tokenizer
    (every SmolLM2 study does; the from-scratch study reads only the sample corpus and its tokenizer)."""
    model = os.path.join(REPO, SMOLLM2)
    return any(study.baselines or any(model in (os.path.join(REPO, v.experiment.model.init),
                                                os.path.join(REPO, v.experiment.data.tokenizer))
                                      for v in variants(r, study)) for study in r.studies)


def shard_builds(r: Reproduction) -> list[tuple[str, str, BuildConfig]]:
    """(stage, what, build) of the shards the selected studies' runs read that the trainer does not build."""
    reviews = (f"{REAL}/text/reviews.jsonl",)
    pairs = tuple(sorted(glob.glob(os.path.join(REPO, REAL, "pairs", "*.jsonl"))))
    builds = []
    if unit_len := UNIT_SEQ_LEN.get(r.mode):  # the SmolLM2 scales
        units = UNIT_SHARDS.format(seq_len=unit_len)
        builds.append(("unit_shards", f"sentence units of {reviews[0]} ({unit_len} tokens) into {units}",
                       BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=units, seq_len=unit_len,
                                   units="sentence", progress=False)))
    if span_len := SPAN_SEQ_LEN.get(r.mode):
        spans = SPAN_SHARDS.format(seq_len=span_len)
        builds.append(("span_shards", f"{reviews[0]} packed into {span_len} tokens with spans into {spans}",
                       BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=spans, seq_len=span_len,
                                   span_fraction=0.15, progress=False)))
    builds.append(("pair_shards", f"{REAL}/pairs (64 tokens a text) into {PAIR_SHARDS}",
                   BuildConfig(inputs=pairs, tokenizer=SMOLLM2, output=PAIR_SHARDS, seq_len=64, pairs=True,
                               instructions=f"{REAL}/pairs/instructions.json", progress=False)))
    read = {os.path.join(REPO, path) for study in r.studies for v in variants(r, study)
            for path in (v.experiment.data.shards, v.experiment.data.unit_shards, v.experiment.data.pair_shards)
            if path}
    return [b for b in builds if os.path.join(REPO, b[2].output) in read]


def inputs(r: Reproduction) -> list[str]:
    """What the scale reads that nothing here makes from something else (absolute paths): the extracted data
    (``make real-data``), SmolLM2 where a study reads it, each run's tokenizer and the files its trainer builds
    shards from (a pattern's directory). Their size is what a machine with nothing under runs/ must be given
    (gpu-short: <= 40 MB)."""
    paths = {os.path.join(REPO, REAL)} | ({os.path.join(REPO, SMOLLM2)} if reads_smollm2(r) else set())
    for study in r.studies:
        for v in variants(r, study):
            paths.add(os.path.join(REPO, v.experiment.data.tokenizer))
            paths.update(os.path.join(REPO, pattern.split("*")[0].rstrip(os.sep))
                         for pattern in v.experiment.data.build_inputs)
    return sorted(p for p in paths if not any(p.startswith(other + os.sep) for other in paths))


def prepare_inputs(r: Reproduction, stages: Stages) -> None:
    """The real data extracted, SmolLM2 imported where a study reads it, the shards the runs read built."""
    if not is_extracted(os.path.join(REPO, REAL)):
        extract(os.path.join(REPO, DOWNLOADS), os.path.join(REPO, REAL))
    if reads_smollm2(r) and not os.path.isfile(os.path.join(REPO, SMOLLM2, "config.json")):
        stages.run("import_smollm2", f"import the packaged GGUF into {SMOLLM2}",
                   lambda: print(f"wrote {import_gguf(packaged_gguf(), SMOLLM2)}"))
    for stage, what, config in [] if r.records else shard_builds(r):
        if not os.path.isfile(os.path.join(REPO, config.output, MANIFEST)):
            stages.run(stage, what, lambda config=config: run_job(config))
