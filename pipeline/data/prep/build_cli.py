"""The data prep's command line: tokenize text into webdataset shards with document boundaries, masking plans and
MAGNET spans (``pipeline.data.prep.build.run_job``; ``pipeline-build-shards`` runs the same):

    python data_prep/build_shards.py --input 'train/chunk*/example_train_*.jsonl.zst' \\
        --tokenizer TOKENIZER_DIR --output shards/ --seq-len 2048 --num-jobs 64 --job-index 0 --workers 8

Sentence units (one sentence a sample, 128 tokens, for SimCSE / MAGNET's SSCL) instead of packed documents:

    python data_prep/build_shards.py --input ... --tokenizer TOKENIZER_DIR --output units/ --units sentence

(query, positive, hard negatives) rows with task instructions, one row a sample (LLM2Vec's supervised stage):

    python data_prep/build_shards.py --input 'echo-data/*.jsonl' --pairs --negatives 1 --max-text-tokens 512 \
        --instructions data_prep/instructions/e5.json --tokenizer TOKENIZER_DIR --output pairs/

Job k of K takes the sorted inputs k::K; under a SLURM array the job index and count default to the array task's.
Re-running is safe: a finished job does nothing, a killed one redoes only what is missing. See docs/data_prep.md.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from pipeline.data.format.units import UNIT_MODES
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.sources import InputError

DEFAULT_UNIT_TOKENS = 128  # LLM2Vec's SimCSE max_seq_length
DEFAULT_TEXT_TOKENS = 512  # LLM2Vec's supervised max_seq_length


def slurm_array_defaults(env: dict) -> tuple[int, int]:
    """(job index, job count) of a SLURM array task; the index is made 0-based when the array starts elsewhere."""
    if "SLURM_ARRAY_TASK_ID" not in env:
        return 0, 1
    index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
    return index, int(env.get("SLURM_ARRAY_TASK_COUNT", 1))


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    job_index, num_jobs = slurm_array_defaults(dict(os.environ))
    d = BuildConfig(inputs=(), tokenizer="", output="")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("input and output")
    io.add_argument("--input", nargs="+", required=True, metavar="GLOB",
                    help=".jsonl/.jsonl.zst/.jsonl.gz/.parquet files (globs, quoted) or saved HF dataset directories")
    io.add_argument("--text-field", default=d.text_field, help="record field holding the document text")
    io.add_argument("--source-field", default=d.source_field, metavar="FIELD",
                    help="record field naming the document's source, dotted into nested objects (SlimPajama: "
                         "meta.redpajama_set_name); each source is packed apart and counted in the manifest")
    io.add_argument("--source-default", default=d.source_default, metavar="NAME",
                    help="the source of records without --source-field (default: such records are bad); "
                         "alone, the source of every record")
    io.add_argument("--tokenizer", required=True, help="HF tokenizer directory or sentencepiece .model file")
    io.add_argument("--output", required=True, help="shard directory (shared by all jobs)")
    io.add_argument("--prefix", default=d.prefix, help="shard names are PREFIX-JOB-N.tar")
    io.add_argument("--samples-per-shard", type=int, default=d.samples_per_shard)
    pack = p.add_argument_group("packing")
    pack.add_argument("--seq-len", type=int, default=None, help=f"tokens per packed sample (default {d.seq_len})")
    pack.add_argument("--bos", action=argparse.BooleanOptionalAction, default=d.bos,
                      help="start each document with the tokenizer's BOS token")
    pack.add_argument("--eos", action=argparse.BooleanOptionalAction, default=d.eos,
                      help="end each document with the tokenizer's EOS token")
    pack.add_argument("--remainder", choices=("drop", "pad"), default=d.remainder,
                      help="what to do with each file's last, incomplete sample")
    units = p.add_argument_group("sentence units (contrastive objectives: SimCSE, MAGNET's SSCL) instead of packing")
    units.add_argument("--units", choices=UNIT_MODES, default=None,
                       help="one unit a sample: each sentence, paragraph or whole record (docs/data_prep.md)")
    units.add_argument("--max-unit-tokens", type=int, default=None,
                       help=f"unit samples' length, BOS and EOS included; longer units are cut (default "
                            f"{DEFAULT_UNIT_TOKENS})")
    units.add_argument("--paraphrase-field", default="",
                       help="with --units record: the field holding a paraphrase of the text, stored beside it")
    pairs = p.add_argument_group("(query, positive, negatives) rows for the supervised objective instead of packing")
    pairs.add_argument("--pairs", action="store_true",
                       help="jsonl rows {query, positive, negative: str | [str], instruction?, doc_instruction?, "
                            "task?} (the task defaults to the file's stem), one a sample (docs/data_prep.md)")
    pairs.add_argument("--negatives", type=int, default=d.negatives,
                       help="hard negatives kept per row; rows with fewer are bad records")
    pairs.add_argument("--max-text-tokens", type=int, default=None,
                       help=f"tokens a text (BOS, instruction and EOS included); longer ones are cut (default "
                            f"{DEFAULT_TEXT_TOKENS})")
    pairs.add_argument("--instructions", default="",
                       help='JSON {task: {"query": str | [str], "document": str | null | [str | null]}}: the '
                            "instructions of rows that have no instruction field")
    pairs.add_argument("--instruction-format", default=d.instruction_format,
                       help="how an instruction becomes a text's prefix (the trained model's exports format "
                            "queries' instructions the same way)")
    plan = p.add_argument_group("masking plan and MAGNET spans")
    plan.add_argument("--seed", type=int, default=d.seed,
                      help="seeds every sample's masking plan and spans (the plan serves every mask ratio)")
    plan.add_argument("--span-min", type=int, default=d.span_min, help="shortest MAGNET span, in tokens")
    plan.add_argument("--span-max", type=int, default=d.span_max, help="longest MAGNET span, in tokens")
    plan.add_argument("--span-fraction", type=float, default=d.span_fraction,
                      help="target fraction of each sample's document tokens inside spans")
    run = p.add_argument_group("jobs and processes")
    run.add_argument("--num-jobs", type=int, default=num_jobs,
                     help="independent jobs sharing the inputs (default: SLURM_ARRAY_TASK_COUNT or 1)")
    run.add_argument("--job-index", type=int, default=job_index,
                     help="this job, 0-based (default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN or 0)")
    run.add_argument("--workers", type=int, default=d.workers, help="processes in this job, one per core")
    run.add_argument("--max-bad-fraction", type=float, default=d.max_bad_fraction,
                     help="fail when a file has more bad records than this fraction")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a = p.parse_args(argv)
    if (a.units or a.pairs) and a.seq_len is not None:
        p.error("--seq-len is for packed samples; unit samples are --max-unit-tokens long, pairs' texts "
                "--max-text-tokens")
    if not a.units and a.max_unit_tokens is not None:
        p.error("--max-unit-tokens needs --units")
    if not a.pairs and (a.max_text_tokens is not None or a.instructions):
        p.error("--max-text-tokens and --instructions need --pairs")
    seq_len = ((a.max_unit_tokens or DEFAULT_UNIT_TOKENS) if a.units else
               (a.max_text_tokens or DEFAULT_TEXT_TOKENS) if a.pairs else (a.seq_len or d.seq_len))
    return BuildConfig(inputs=tuple(a.input), tokenizer=a.tokenizer, output=a.output, seq_len=seq_len, seed=a.seed,
                       text_field=a.text_field, num_jobs=a.num_jobs, job_index=a.job_index, workers=a.workers,
                       prefix=a.prefix, samples_per_shard=a.samples_per_shard, bos=a.bos, eos=a.eos,
                       remainder=a.remainder, span_min=a.span_min, span_max=a.span_max,
                       span_fraction=a.span_fraction, max_bad_fraction=a.max_bad_fraction, progress=a.progress,
                       units=a.units or "", paraphrase_field=a.paraphrase_field, source_field=a.source_field,
                       source_default=a.source_default, pairs=a.pairs, negatives=a.negatives,
                       instructions=a.instructions, instruction_format=a.instruction_format)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        run_job(cfg)
    except (BuildError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: no space left on device: {e.filename or cfg.output}; the shards this job committed are "
              f"intact: free space and run the same command again to continue", file=sys.stderr)
        return 1
    return 0
