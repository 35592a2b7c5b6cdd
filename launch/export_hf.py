"""Export a training checkpoint as an HF ``save_pretrained`` directory, offline, in one process:
``python launch/export_hf.py --run RUN_DIR [--step N] --output DIR [--dtype fp32|bf16]
[--sentence-transformers [--pooling P] [--layout L]]``.

Reads the fp32 master weights of a ZeRO checkpoint (DeepSpeed's ``zero_to_fp32``), the model config and the
tokenizer recorded in the run directory, and writes the training record into config.json (docs/export.md).
``--sentence-transformers`` also makes DIR a sentence-transformers model (``SentenceTransformer(DIR)``);
``--pooling`` / ``--layout`` override the recorded defaults. Training also exports at its end (``train.export_hf``).
"""

from __future__ import annotations

import argparse
import os
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

    from dataclasses import replace

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.export.record import from_experiment
    from pipeline.export.sentence_transformers import check_expressible, write_sentence_transformers
    from pipeline.io import read_json
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train import checkpoint
    from pipeline.train.model import save_hf

    steps = checkpoint.complete_steps(args.run)
    if not steps:
        print(f"error: {args.run} has no complete checkpoint (looked in {checkpoint.checkpoint_root(args.run)})",
              file=sys.stderr)
        return 2
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"error: {args.run} has no complete checkpoint at step {step}; complete steps: {steps}", file=sys.stderr)
        return 2
    exp = read_json(os.path.join(args.run, "experiment.json"), "not a run directory of launch/train.py")
    model_config = read_json(os.path.join(args.run, "model_config.json"), "not a run directory of launch/train.py")
    tokenizer = load_tokenizer(exp["data"]["tokenizer"])
    record = replace(from_experiment(exp, tokenizer), **{k: v for k, v in (("pooling", args.pooling),
                                                                           ("layout", args.layout)) if v})
    if args.sentence_transformers:
        try:  # before reading the weights
            check_expressible(record)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint.checkpoint_root(args.run), tag=checkpoint.tag_for(step))
    config = AutoConfig.for_model(**model_config)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_hf(lm, {k: v.to(dtype) for k, v in sd.items()}, tokenizer, args.output, record)
    if args.sentence_transformers:
        write_sentence_transformers(args.output, record)
    print(f"exported {checkpoint.tag_for(step)} of {args.run} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
