"""Expand an experiment grid into run directories and submit them:
``python launch/sweep.py GRID [--smoke] [--only PATTERN] [--out runs] [--set KEY=VALUE] [--write | --submit | --local]``.

Prints the grid as a table (run, model, steps, tokens, phases, start run, state) and writes nothing. ``--write``
also writes OUT/RUN/experiment.yaml and OUT/RUN/job.sbatch for every selected run that has not finished;
``--submit`` writes them and sbatches them (finished and queued runs are skipped; unfinished ones resume from their
newest checkpoint; a run that continues another one waits for its job); ``--local`` writes them and trains them
one after another on this machine. See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml  # noqa: E402

from pipeline.config import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="grid file, e.g. experiments/mlm_vs_clm/grid.yaml")
    p.add_argument("--smoke", action="store_true", help="the -smoke twins (tiny model, sample corpus, CPU ranks)")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="runs whose name matches this shell pattern, e.g. 'switch-610m-*' (repeatable)")
    p.add_argument("--out", default="runs", help="parent directory of the run directories (default: runs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set an experiment field in every run, e.g. data.shards=/data/shards (repeatable)")
    p.add_argument("--nodes", type=int, help="nodes per run (default: the grid's resources)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the grid's resources)")
    p.add_argument("--time", help="SLURM time limit of one job, e.g. 24:00:00 (the run requeues itself)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="write the run directories and job files, submit nothing")
    action.add_argument("--submit", action="store_true", help="sbatch the unfinished runs")
    action.add_argument("--local", action="store_true", help="train the unfinished runs here, one after another")
    args = p.parse_args(argv)

    from dataclasses import replace

    from pipeline.grid import load_grid
    from pipeline.sweep import (
        check_inputs,
        in_order,
        queued_jobs,
        run_local,
        run_states,
        select,
        submit,
        table,
        write_run,
    )

    try:
        overrides = {}
        for item in args.overrides:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. data.shards=/data/shards")
            key, raw = item.split("=", 1)
            overrides[key.strip()] = yaml.safe_load(raw)
        grid = load_grid(args.grid)
        base = grid.spec.smoke.resources if args.smoke else grid.spec.resources
        resources = replace(base, **{k: v for k, v in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node),
                                                       ("time", args.time)) if v is not None})
        resources.validate()
        everything = grid.variants(smoke=args.smoke, out=os.path.abspath(args.out), overrides=overrides,
                                   resources=resources)
        selected = select(everything, args.only)
        states = run_states(everything, queued_jobs([v.name for v in everything]) if args.submit else {})
        print(table(selected, states))
        todo = in_order([v for v in selected if states[v.name].kind != "finished"], everything, states)
        writing = args.write or args.submit or args.local
        for v in todo if writing else ():
            if states[v.name].kind != "queued":
                write_run(grid, v, states[v.name])
        if args.submit or args.local:
            for v in todo:
                check_inputs(v)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = sum(states[v.name].kind == "finished" for v in selected)
    print(f"\n{len(selected)} runs: {done} finished, {len(todo)} to do; " + (
        f"run directories under {args.out}/" if writing else "nothing written (--write, --submit or --local to act)"))
    try:
        if args.submit:
            jobs = {name: s.job for name, s in states.items() if s.kind == "queued"}
            for v in todo:
                if states[v.name].kind == "queued":
                    print(f"{v.name}: already queued as job {jobs[v.name]}")
                    continue
                after = [jobs[d] for d in v.after if d in jobs]
                jobs[v.name] = submit(v, after)
                print(f"{v.name}: submitted job {jobs[v.name]}" + (f" (after job {', '.join(map(str, after))})"
                                                                    if after else ""))
        elif args.local:
            for v in todo:
                run_local(grid, v)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
