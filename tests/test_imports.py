"""The house's import rule (docs/architecture.md): imports go down, so nothing outside pipeline/train/ imports
pipeline.train, and the launch/ scripts only call a library ``main``."""

from __future__ import annotations

import ast
import os

from helpers import REPO


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
