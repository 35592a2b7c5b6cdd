"""A sweep: a grid's runs as run directories, their state, one sbatch file each, submission in dependency order,
and its command line: ``python launch/sweep.py GRID [--smoke] [--only PATTERN] [--out runs] [--set KEY=VALUE]
[--write | --submit | --local]`` (or ``pipeline-sweep ...``).

The command prints the grid as a table (run, model, steps, tokens, phases, start run, state) and writes nothing.
``--write`` also writes OUT/RUN/experiment.yaml and OUT/RUN/job.sbatch for every selected run that has not finished;
``--submit`` writes them and sbatches them (finished and queued runs are skipped; unfinished ones resume from their
newest checkpoint; a run that continues another one waits for its job); ``--local`` writes them and trains them
one after another on this machine. See docs/experiments.md.

Per run ``OUT/NAME/``: ``experiment.yaml`` (the resolved experiment the job reads; training rewrites the same
content) and ``job.sbatch`` (launch/slurm/train.sbatch's directives with this run's name, size and log, then
train.sbatch itself on this run). Submitting again is safe: finished runs are skipped, queued ones left alone and
unfinished ones submitted again, to resume from their newest complete checkpoint. A run that reads another run's
output waits for that job (``--dependency=afterok``; train.sbatch requeues itself at the time limit, so the job
ends only when the run has finished).
"""

# The package (the docstring above is the command's --help): plan.py resolves a request into run directories in
# dependency order, status.py tells each run's state and prints the table, slurm.py writes the job files and submits
# them, local.py trains them here; this module is the command line.

from __future__ import annotations

import argparse
import sys

from pipeline.config import ConfigError
from pipeline.sweep.plan import SweepRequest, act, prepare


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
    action.add_argument("--write", dest="action", action="store_const", const="write",
                        help="write the run directories and job files, submit nothing")
    action.add_argument("--submit", dest="action", action="store_const", const="submit",
                        help="sbatch the unfinished runs")
    action.add_argument("--local", dest="action", action="store_const", const="local",
                        help="train the unfinished runs here, one after another")
    p.set_defaults(action="show")
    request = SweepRequest(**vars(p.parse_args(argv)))
    try:
        sweep = prepare(request)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        act(sweep)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
