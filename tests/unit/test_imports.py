"""The house's import rule (docs/architecture.md): imports go down, so nothing outside pipeline/train/ imports
pipeline.train, and the launch/ scripts only call a library ``main``."""

from __future__ import annotations

import ast
import os
import subprocess

import pytest
from helpers import REPO, venv_without


def imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def python_files(top: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(os.path.join(REPO, top)) for f in files if f.endswith(".py")]


def test_nothing_outside_the_trainer_imports_it():
    climbing = {os.path.relpath(p, REPO): sorted(m for m in imported_modules(p) if m.startswith("pipeline.train"))
                for p in python_files("pipeline") if "/pipeline/train/" not in p}
    assert {p: m for p, m in climbing.items() if m} == {}


def test_launch_scripts_parse_no_options_themselves():
    for path in python_files("launch"):
        assert "argparse" not in imported_modules(path), f"{path}: parse the options in the library's main"


# scripts that get no command, and why; every other script of launch/ and data_prep/ must have one
NOT_COMMANDS = {
    "launch/train.py": "runs under DeepSpeed's launcher (deepspeed launch/train.py)",
    "launch/_repo.py": "not a script: what every launch/ script imports first (the checkout's root on sys.path)",
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
    """Each script imports launch/_repo.py before any ``pipeline`` module (checked on the source, no start-up)."""
    for path in python_files("launch"):
        if path.endswith("_repo.py"):
            continue
        imports = [n for n in ast.parse(open(path).read(), path).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        first = next(i for i, n in enumerate(imports) if isinstance(n, ast.ImportFrom)
                     and (n.module or "").startswith("pipeline"))
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


def test_training_reads_shards_without_data_prep():
    """pipeline/data/ says by its folders what training reaches: format/ (the shard contract) and loading/ stand on
    their own, and the trainer reaches prep/ only through preflight's build of missing shards."""
    def prep_imports(top: str) -> dict[str, list[str]]:
        found = {os.path.relpath(p, REPO): sorted(m for m in imported_modules(p) if m.startswith("pipeline.data.prep"))
                 for p in python_files(top)}
        return {p: m for p, m in found.items() if m}
    assert prep_imports("pipeline/data/format") == prep_imports("pipeline/data/loading") == {}
    assert set(prep_imports("pipeline/train")) <= {"pipeline/train/preflight.py"}
    assert prep_imports("pipeline/objectives") == prep_imports("pipeline/model") == {}
