"""The options of one shard-building job (``data_prep/build_shards.py``), their checks, and the settings that
determine the shard bytes (the manifest's fingerprinted ``settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.format.instructions import DEFAULT_FORMAT, check_format, load_instructions
from pipeline.data.format.sample import MAX_SEQ_LEN
from pipeline.data.format.units import UNIT_MODES
from pipeline.data.prep.packing import REMAINDER_POLICIES
from pipeline.data.prep.pairs import PairsSettings
from pipeline.data.prep.sources import SourceField, input_size


class BuildError(RuntimeError):
    """A job that must not go on (other settings in the output directory, too many bad records, ...)."""


@dataclass(frozen=True)
class BuildConfig:
    """The options of one job (docs/data_prep.md). All but ``num_jobs``, ``job_index``, ``workers``,
    ``max_bad_fraction`` and ``progress`` determine the shard bytes and are fixed by the directory's manifest."""

    inputs: tuple[str, ...]
    tokenizer: str
    output: str
    seq_len: int = 2048
    seed: int = 0
    text_field: str = "text"
    num_jobs: int = 1
    job_index: int = 0
    workers: int = 1
    prefix: str = "shard"
    samples_per_shard: int = 4096
    bos: bool = True
    eos: bool = True
    remainder: str = "drop"
    span_min: int = 8
    span_max: int = 32
    span_fraction: float = 0.15
    max_bad_fraction: float = 0.01
    progress: bool = True
    units: str = ""  # "": pack documents; "sentence", "paragraph", "record": one unit per sample of seq_len tokens
    paraphrase_field: str = ""  # with units "record": the record field holding the text's paraphrase
    source_field: str = ""  # the record field naming its source, dotted into objects (meta.redpajama_set_name)
    source_default: str = ""  # the source of records without one ("": such a record is bad); alone: every record's
    # pairs mode (pairs.py): one (query, positive, negatives) row a sample, seq_len tokens a text
    pairs: bool = False
    negatives: int = 1  # hard negatives kept per row (rows with fewer are bad)
    instructions: str = ""  # JSON {task: {"query": ..., "document": ...}}; "": rows' own instructions only
    instruction_format: str = DEFAULT_FORMAT

    def pairs_settings(self) -> PairsSettings:
        """The pairs layout, with the instruction table read (its contents, not its path, fix the bytes)."""
        try:
            table = load_instructions(self.instructions) if self.instructions else {}
        except (OSError, ValueError) as e:
            raise BuildError(f"--instructions: {e}") from e
        return PairsSettings(self.negatives, self.seq_len, self.instruction_format, table)

    @property
    def source(self) -> SourceField | None:
        """Where records name their source; None when the shards record no sources (one unnamed source)."""
        return SourceField(self.source_field, self.source_default) if self.source_field or self.source_default \
            else None

    def validate(self) -> None:
        if self.pairs:
            try:
                check_format(self.instruction_format)
            except ValueError as e:
                raise BuildError(f"--instruction-format: {e}") from None
        checks = [
            (not (self.pairs and self.units), "--pairs and --units are two modes; pick one"),
            (not (self.pairs and self.source is not None),
             "--pairs takes no --source-field / --source-default: a pairs row's source is its task (its \"task\" "
             "field or its file's stem), which data.pair_mixture mixes"),
            (self.negatives >= 0, f"--negatives must be >= 0, got {self.negatives}"),
            (not self.pairs or (2 + self.negatives) * self.seq_len <= MAX_SEQ_LEN,
             f"--pairs: {2 + self.negatives} texts of --max-text-tokens {self.seq_len} exceed {MAX_SEQ_LEN} tokens a "
             f"sample"),
            (not self.pairs or self.seq_len >= 2 + self.bos + self.eos,
             f"--max-text-tokens {self.seq_len} leaves no room for text between BOS and EOS"),
            (1 <= self.seq_len <= MAX_SEQ_LEN, f"--seq-len must be in [1, {MAX_SEQ_LEN}], got {self.seq_len}"),
            (0 <= self.seed < 1 << 64, f"--seed must be in [0, 2**64), got {self.seed}"),
            (self.num_jobs >= 1, f"--num-jobs must be >= 1, got {self.num_jobs}"),
            (0 <= self.job_index < self.num_jobs,
             f"--job-index must be in [0, {self.num_jobs}) for --num-jobs {self.num_jobs}, got {self.job_index}"),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
            (self.samples_per_shard >= 1, f"--samples-per-shard must be >= 1, got {self.samples_per_shard}"),
            (self.remainder in REMAINDER_POLICIES, f"--remainder must be one of {REMAINDER_POLICIES}"),
            (1 <= self.span_min <= self.span_max, f"need 1 <= --span-min <= --span-max, got "
                                                  f"{self.span_min}..{self.span_max}"),
            (0.0 <= self.span_fraction < 1.0, f"--span-fraction must be in [0, 1), got {self.span_fraction}"),
            (0.0 <= self.max_bad_fraction <= 1.0,
             f"--max-bad-fraction must be in [0, 1], got {self.max_bad_fraction}"),
            (self.prefix and "/" not in self.prefix, f"--prefix must be a plain file name prefix, got {self.prefix!r}"),
            (self.units in ("", *UNIT_MODES), f"--units must be one of {', '.join(UNIT_MODES)}, got {self.units!r}"),
            (not self.paraphrase_field or self.units == "record",
             f"--paraphrase-field needs --units record (each record is one unit, its paraphrase beside it), got "
             f"--units {self.units or '(none: packed)'}"),
            (not self.source_default or self.source_default.strip() == self.source_default,
             f"--source-default must be a name without surrounding blanks, got {self.source_default!r}"),
            (not self.units or self.seq_len >= 1 + self.bos + self.eos,
             f"--max-unit-tokens {self.seq_len} leaves no room for text between BOS and EOS"),
        ]
        for ok, message in checks:
            if not ok:
                raise BuildError(message)

    def shard_settings(self, tokenizer_info: dict, pad_id: int, inputs: list[str]) -> dict:
        """Everything that determines the shard bytes (fingerprinted; a later job with other settings is
        refused). Unit shards record their mode (and paraphrase field) instead of the packing and span settings they
        do not use; packed shards have no ``units`` key, so their settings (and fingerprints) are those of earlier
        versions. Likewise ``source_field`` and ``source_default`` are there only when sources are recorded. Pairs
        settings' ``sources: task`` marks shards written a stream per task (each shard's source its rows' task), whose
        bytes differ from the one stream of earlier builds where a file holds several tasks."""
        settings = {
            "tokenizer": tokenizer_info,
            "pad_id": pad_id,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "bos": self.bos,
            "eos": self.eos,
            "remainder": self.remainder,
            "text_field": self.text_field,
            "span_min": self.span_min,
            "span_max": self.span_max,
            "span_fraction": self.span_fraction,
            "inputs": [{"path": p, "bytes": input_size(p)} for p in inputs],
            "prefix": self.prefix,
            "samples_per_shard": self.samples_per_shard,
        }
        if self.units or self.pairs:
            for unused in ("remainder", "span_min", "span_max", "span_fraction"):
                del settings[unused]
        if self.units:
            settings |= {"units": self.units, "paraphrase_field": self.paraphrase_field or None}
        if self.pairs:
            p = self.pairs_settings()
            del settings["text_field"]
            settings |= {"seq_len": p.slots * p.width,
                         "pairs": {"slots": p.slots, "width": p.width, "negatives": p.negatives,
                                   "instruction_format": p.instruction_format, "instructions": p.instructions,
                                   "sources": "task"}}
        if self.source is not None:
            settings |= {"source_field": self.source_field, "source_default": self.source_default}
        return settings
