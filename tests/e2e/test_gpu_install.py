"""bench/gpu's install recipe on CPU, so that it cannot rot between GPU loans: prepare.sh fetches the pinned wheels
for this Python, and run.sh installs exactly them (install.sh: no index, no pip configuration) into an environment
that lacks them as the lent GPU's image does, checks the imports, prints the versions and starts ablate.py (its
--help: tests/e2e/test_bench.py runs the benchmark itself). prepare.sh's default, the GPU's cp312 set, is fetched too.
Needs PyPI; ~1 min. And, at once, that the pins are the lock's versions (constraints.txt)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from helpers import canonical, venv_without

from pipeline.constraints import GPU_PINS, LOCK, read_pins

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
GPU = os.path.join(REPO, "bench", "gpu")
# The lent GPU's image as this test models it: this venv less what the image lacks (the device tool's KINDS.md,
# "Python packages already there", read 2026-11-17) or may hold too old (typing-extensions, for pydantic).
# requirements.txt must bring all of it that training needs ...
LACKING = ("deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
           "typing-extensions", "zstandard")
# ... and the rest must not be needed (the project itself comes from the checkout)
NOT_NEEDED = ("decoder-encoders", "datasets", "mteb", "webdataset", "wids")


def test_the_gpus_pins_are_the_locks_versions():
    """The GPU installs what the suite passed with: wherever the lock and requirements.txt both name a package
    (DeepSpeed among them), one version; `make lock` rewrites both."""
    pinned, locked = read_pins(GPU_PINS), read_pins(LOCK)
    assert "deepspeed" in pinned.keys() & locked.keys()
    assert {name: (version, locked[name]) for name, version in pinned.items()
            if name in locked and locked[name] != version} == {}


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/deepspeed/", timeout=10).close()
        return True
    except OSError:
        return False


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def prepare(out, *args) -> dict[str, tuple[str, str]]:
    """prepare.sh into ``out``: {canonical name: (version, wheel tags)} of the wheels it left."""
    run([os.path.join(GPU, "prepare.sh"), "--out", str(out), *args], env={**os.environ, "PYTHON": sys.executable})
    wheels = {}
    for name in os.listdir(out):
        dist, version, *_, python, abi, platform = name.removesuffix(".whl").split("-")
        assert canonical(dist) not in wheels, f"two wheels of {dist} in {out}"
        wheels[canonical(dist)] = (version, f"{python}-{abi}-{platform}")
    return wheels


@pytest.mark.slow
@pytest.mark.e2e
def test_prepared_wheels_install_offline_and_import_the_pipeline(tmp_path):
    if not pypi_reachable():
        pytest.skip("prepare.sh needs PyPI (https://pypi.org unreachable)")
    pinned = read_pins(GPU_PINS)
    # the GPU's set (prepare.sh's default): one wheel a pin, for CPython 3.12 on x86-64 or pure Python
    gpu = prepare(tmp_path / "gpu-wheels")
    assert {name: version for name, (version, _) in gpu.items()} == pinned
    assert gpu["deepspeed"][1] == "py3-none-any"
    assert all(tags == "py3-none-any" or re.fullmatch(r"cp312-cp312-\S*manylinux\S*_x86_64", tags)
               for _, tags in gpu.values()), gpu

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = tmp_path / "wheels"
    assert set(prepare(wheels, "--python-version", here)) == set(pinned)
    python, venv_site = venv_without({canonical(n) for n in LACKING + NOT_NEEDED}, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    missing = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "No module named 'deepspeed'" in missing.stderr  # else the install below would prove nothing

    proc = run([os.path.join(GPU, "run.sh"), str(tmp_path / "out"), "--help"], cwd=tmp_path,
               env={**env, "PYTHON": python, "WHEELS": str(wheels), "DS_ACCELERATOR": "cpu"})
    assert f"deepspeed {pinned['deepspeed']}; " in proc.stdout and f"deepspeed from {venv_site}" in proc.stdout
    assert "usage: ablate.py" in proc.stdout
    installed = json.loads(run([python, "-m", "pip", "list", "--path", venv_site, "--format", "json"], env=env).stdout)
    assert {canonical(d["name"]): d["version"] for d in installed} == pinned
