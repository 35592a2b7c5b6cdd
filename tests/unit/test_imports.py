"""The house's import rules (docs/architecture.md): imports go down the layer table below, pipeline's modules import
one another in no cycle, and the launch/ scripts only call a library ``main``. Every import counts, function-local
and ``TYPE_CHECKING`` ones too: each is an arrow between the modules."""

from __future__ import annotations

import ast
import os
import subprocess

import pytest
from helpers import REPO, venv_without


def python_files(top: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(os.path.join(REPO, top)) for f in files if f.endswith(".py")]


def module_name(path: str) -> str:
    return os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")


MODULES = {module_name(p): os.path.relpath(p, REPO) for p in python_files("pipeline")}  # dotted name -> file


def imported_modules(path: str) -> set[str]:
    """Every module ``path`` imports anywhere in it; ``from P import m`` of a pipeline module ``P.m`` is that
    module, and a relative import is read from the importing module's package."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) + 1 - node.level]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names}
    return found


# The house, bottom row first. A module imports its own package and the packages of the rows below; never a row
# above, nor a package beside its own on the same row (those two stand apart). A module lies in the longest package
# here that holds it (pipeline.eval.report is pipeline.eval's); every module of pipeline/ lies in one.
LAYERS = (
    ("pipeline.io", "pipeline.lock", "pipeline.safe_load", "pipeline.constraints", "pipeline.tokenizer"),
    # the typed configs; the shard contract prep and training share; every evaluation task described (TaskSpec)
    ("pipeline.config", "pipeline.data.format", "pipeline.tasks"),
    ("pipeline.data.loading", "pipeline.model"),  # what training reads shards with; the plain-PyTorch/HF model
    ("pipeline.objectives", "pipeline.data.prep"),  # the losses; offline data prep (format/ and loading/ below it)
    ("pipeline.experiment",),  # the experiment config everything above reads
    ("pipeline.run_dir", "pipeline.inputs", "pipeline.grid"),
    ("pipeline.export",),  # the HF directory
    ("pipeline.eval", "pipeline.planner"),  # evaluation reads exports; the cluster planner
    ("pipeline.sweep", "pipeline.mining"),  # mining embeds with eval's encoder and builds shards with prep
    ("pipeline.reproduce",),
    ("pipeline.train",),  # the trainer, on top: nothing outside pipeline/train/ imports it
)
ROW = {package: i for i, row in enumerate(LAYERS) for package in row}


def package_of(module: str) -> str | None:
    return max((p for p in ROW if module == p or module.startswith(p + ".")), key=len, default=None)


def arrows() -> set[tuple[str, str]]:
    """(importing module, imported pipeline module) of every import in pipeline/."""
    return {(m, i) for m, path in MODULES.items() for i in imported_modules(os.path.join(REPO, path))
            if i.split(".")[0] == "pipeline"}


def test_imports_go_down_the_layer_table():
    unplaced = [path for m, path in MODULES.items()
                if package_of(m) is None and os.path.getsize(os.path.join(REPO, path))]  # not the empty parents
    assert not unplaced, f"{unplaced}: place each module's package in LAYERS (tests/unit/test_imports.py)"
    wrong = []
    for m, i in sorted(arrows()):
        mine, theirs = package_of(m), package_of(i)
        if mine == theirs or ROW[theirs] < ROW[mine]:
            continue
        rule = (f"{mine} (row {ROW[mine]}) imports no row above its own, and {theirs} is row {ROW[theirs]}"
                if ROW[theirs] > ROW[mine] else f"{mine} and {theirs} stand apart on row {ROW[mine]}")
        wrong.append(f"{MODULES[m]} imports {i}: {rule} (tests/unit/test_imports.py LAYERS)")
    assert not wrong, "\n".join(wrong)


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (its modules, the first again at the end), or [] when it has none."""
    done, path = set(), []

    def visit(m: str) -> list[str]:
        path.append(m)
        for n in sorted(graph[m]):
            if n in path:
                return path[path.index(n):] + [n]
            if n not in done and (cycle := visit(n)):
                return cycle
        done.add(path.pop())
        return []

    return next((cycle for m in sorted(graph) if m not in done and (cycle := visit(m))), [])


def test_pipeline_modules_import_no_cycle():
    graph = {m: set() for m in MODULES}
    for m, i in arrows():
        if i in MODULES:
            graph[m].add(i)
    cycle = import_cycle(graph)
    assert not cycle, "an import cycle: " + ", ".join(f"{MODULES[a]} imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_launch_scripts_parse_no_options_themselves():
    for path in python_files("launch"):
        assert "argparse" not in imported_modules(path), f"{path}: parse the options in the library's main"


# scripts that get no command, and why; every other script of launch/ and data_prep/ must have one
NOT_COMMANDS = {
    "launch/train.py": "runs under DeepSpeed's launcher (deepspeed launch/train.py)",
    "launch/_repo.py": "not a script: what every launch/ script imports first (the checkout's root on sys.path)",
    "data_prep/_repo.py": "not a script: launch/_repo.py (a link), which every data_prep/ script imports first",
    "data_prep/make_sample_corpus.py": "regenerates the checkout's data/sample",
    "data_prep/make_pairs_sample.py": "regenerates the checkout's data/sample/pairs",
}


def library_main(path: str) -> str | None:
    """``module:main`` for a script that does ``from pipeline.X import main``."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline.")
                and any(a.name == "main" and a.asname is None for a in node.names)):
            return f"{node.module}:main"
    return None


def test_every_script_that_needs_no_launcher_is_a_command_the_readme_lists():
    """[project.scripts] is exactly pipeline-<script name> -> the library main each such script calls, the main
    exists, and README.md names every command."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        commands = tomllib.load(f)["project"]["scripts"]
    scripts = sorted(os.path.join(top, f) for top in ("launch", "data_prep")
                     for f in os.listdir(os.path.join(REPO, top)) if f.endswith(".py"))
    assert set(NOT_COMMANDS) <= set(scripts), "NOT_COMMANDS names a script that is gone"
    expected = {}
    for script in scripts:
        target = library_main(os.path.join(REPO, script))
        if script not in NOT_COMMANDS:
            assert target, f"{script}: call a library main (or list it in NOT_COMMANDS with the reason)"
            expected[f"pipeline-{os.path.basename(script)[:-3].replace('_', '-')}"] = target
    assert commands == expected
    for target in expected.values():
        module = os.path.join(REPO, *target.split(":")[0].split("."))
        module = module + ".py" if os.path.exists(module + ".py") else os.path.join(module, "__init__.py")
        assert "main" in {n.name for n in ast.parse(open(module).read()).body if isinstance(n, ast.FunctionDef)}
    readme = open(os.path.join(REPO, "README.md")).read()
    assert [c for c in commands if f"`{c}`" not in readme] == []


def test_every_launch_script_puts_the_checkout_first_on_sys_path():
    """Each launch/ and data_prep/ script that imports ``pipeline`` imports _repo.py (launch/'s; data_prep/'s is a
    link to it) before any ``pipeline`` module (checked on the source, no start-up): run from a checkout beside an
    editable install of another, it runs its own library."""
    link = os.path.join(REPO, "data_prep", "_repo.py")
    assert os.path.realpath(link) == os.path.realpath(os.path.join(REPO, "launch", "_repo.py"))
    for path in python_files("launch") + python_files("data_prep"):
        if path.endswith("_repo.py"):
            continue
        imports = [n for n in ast.parse(open(path).read(), path).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        first = next((i for i, n in enumerate(imports) if isinstance(n, ast.ImportFrom)
                      and (n.module or "").startswith("pipeline")), None)
        if first is None:
            continue  # data_prep/make_sample_corpus.py: the standard library and zstandard alone
        assert any(isinstance(n, ast.Import) and n.names[0].name == "_repo" for n in imports[:first]), path


@pytest.mark.e2e
def test_deepspeed_train_script_runs_from_a_checkout_that_is_not_installed(tmp_path):
    """``deepspeed launch/train.py`` starts ``python -u launch/train.py`` (issue 32: "No module named 'pipeline'"
    on a checkout that was not pip-installed): a python with every dependency but not the project's editable
    install, no PYTHONPATH, started elsewhere, still reaches the trainer's own usage (~5 s)."""
    python, _ = venv_without({"decoder-encoders"}, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    hidden = subprocess.run([python, "-c", "import pipeline"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "No module named 'pipeline'" in hidden.stderr  # else the run below would prove nothing
    proc = subprocess.run([python, "-u", os.path.join(REPO, "launch", "train.py"), "--help"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "deepspeed launch/train.py --config" in proc.stdout, proc.stderr[-3000:]


def test_training_reaches_data_prep_only_through_preflight_and_evaluation_not_at_all():
    """The trainer builds missing shards in preflight (its shard checks) and reads them with format/ and loading/ alone (which the
    layer table puts below prep/); evaluation reads no shards, and what it shares with prep (how a text is cut into
    sentences) is format/."""
    reaching = {MODULES[m] for m, i in arrows() if package_of(m) in ("pipeline.train", "pipeline.eval")
                and package_of(i) == "pipeline.data.prep"}
    assert reaching <= {"pipeline/train/shard_checks.py"}
