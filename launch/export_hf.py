"""Export a training checkpoint as an HF ``save_pretrained`` directory, offline, in one process:
``python launch/export_hf.py --run RUN_DIR [--step N] --output DIR [--dtype fp32|bf16]
[--sentence-transformers [--pooling P] [--layout L]]``.

:func:`pipeline.train.export.export_checkpoint` reads the fp32 master weights of a ZeRO checkpoint (DeepSpeed's
``zero_to_fp32``), the model config and the tokenizer recorded in the run directory, and writes the training record
into config.json (docs/export.md).
``--sentence-transformers`` also makes DIR a sentence-transformers model (``SentenceTransformer(DIR)``);
``--pooling`` / ``--layout`` override the recorded defaults. Training also exports at its end (``train.export_hf``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (holds checkpoints/ and experiment.json)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--sentence-transformers", action="store_true",
                   help="also write the sentence-transformers files (modules.json, pooling, prompts)")
    p.add_argument("--pooling", choices=["mean", "last", "weighted_mean"], help="default: the run's (recorded)")
    p.add_argument("--layout", choices=["bos_eos", "special", "text"], help="default: the run's (recorded)")
    args = p.parse_args(argv)

    from pipeline.run_dir import RunDir, tag
    from pipeline.train.export import ExportError, export_checkpoint

    try:
        step = export_checkpoint(RunDir(args.run), args.output, args.step, args.dtype, args.sentence_transformers,
                                 args.pooling, args.layout)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {tag(step)} of {args.run} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
