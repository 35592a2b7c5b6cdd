"""The lock, ``constraints.txt``: every package and version of the environment the suite last passed in.

``make setup`` installs with it (pip's ``-c``: it pins what is installed, it adds nothing), bench/gpu/requirements.txt
pins the same versions (tests/e2e/test_gpu_install.py), and ``make lock`` rewrites both from a fresh environment of
the newest versions pyproject.toml allows, once the suite has passed there (``write``). Records (evaluation results,
``make reproduce``'s timings) carry :func:`lock_identity`, so a number says which versions made it.

    python -m pipeline.constraints check    # this environment against the lock: exit 1 and each difference;
                                            # packages not installed (an extra) are counted apart
    python -m pipeline.constraints write    # this environment's versions into the lock and the GPU's pins
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import sys

# the checkout, as pipeline.io's REPO (not imported: the two stand apart on the bottom row of the house)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "constraints.txt")
GPU_PINS = os.path.join(ROOT, "bench", "gpu", "requirements.txt")
PROJECT = "decoder-encoders"  # the editable install of the checkout itself: never locked
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HEADER = """\
# The lock: every package and version of the environment in which the suite (make test, make test-slow) last
# passed, written by `make lock` (README.md, "Install"); make setup installs with it (pip install -c constraints.txt),
# bench/gpu/requirements.txt pins the same versions, pyproject.toml keeps ranges. Local labels are dropped
# (torch==2.13.0 takes the CPU wheel here, a CUDA build elsewhere).
"""


def canonical(name: str) -> str:
    """A distribution's name as pip compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """``version`` without its local label (``2.13.0+cpu`` -> ``2.13.0``), which ``==`` ignores."""
    return version.split("+", 1)[0]


def read_pins(path: str) -> dict[str, str]:
    """A file of ``name==version`` lines (comments and blank lines aside) as {canonical name: version}."""
    pins = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = PIN.fullmatch(line)
            if m is None:
                raise ValueError(f"{path}:{number}: {line!r} is not name==version; the lock and the GPU's "
                                 f"requirements pin each package to one version")
            pins[canonical(m[1])] = m[2]
    return pins


def installed() -> dict[str, str]:
    """{canonical name: version} of what this interpreter sees installed, less the project itself."""
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    found.pop(PROJECT, None)
    return found


def differences(pins: dict[str, str], have: dict[str, str]) -> dict[str, str]:
    """{name: installed version} of each pinned package installed at another version (local labels aside)."""
    return {name: have[name] for name, version in sorted(pins.items())
            if name in have and public(have[name]) != version}


def lock_identity(path: str = LOCK) -> dict | None:
    """Which lock the checkout has (its path and sha256) and where this environment departs from it (``differs``:
    installed versions of locked packages); None where the checkout has no lock (installed from a wheel)."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"path": os.path.relpath(path, ROOT), "sha256": digest, "differs": differences(read_pins(path), installed())}


def required(specs: list[str] | None = None) -> set[str]:
    """The canonical names of ``specs`` (default: the installed project's requirements, pyproject.toml's as of its
    install, every extra's included), the project's own extras aside."""
    if specs is None:
        try:
            specs = importlib.metadata.requires(PROJECT) or []
        except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH: nothing to compare with
            specs = []
    return {canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)[0]) for spec in specs} - {PROJECT}


def write_lock(path: str = LOCK, gpu_pins: str = GPU_PINS, specs: list[str] | None = None) -> list[str]:
    """This environment's versions into the lock, and into the GPU's pins wherever both name a package (the rest of
    that file as it was); returns the GPU's pins that changed, as ``name old -> new``, and the packages the old lock
    had that this environment lacks, as ``name dropped``. An environment without one of the project's requirements
    (``specs``; an extra not installed) is refused before anything is written: its lock would drop them."""
    have = {name: public(version) for name, version in installed().items()}
    if missing := sorted(required(specs) - set(have)):
        raise ValueError(f"pyproject.toml requires {', '.join(missing)}, which this environment lacks: install every "
                         "extra (make setup real-model) and write the lock again")
    dropped = sorted(set(read_pins(path)) - set(have)) if os.path.isfile(path) else []
    with open(path, "w") as f:
        f.write(HEADER + f"# made on Python {platform.python_version()} ({sys.platform}, {platform.machine()})\n")
        f.writelines(f"{name}=={version}\n" for name, version in sorted(have.items()))
    changed, lines = [], []
    with open(gpu_pins) as f:
        for line in f:
            m = PIN.match(line)
            if m and canonical(m[1]) in have and have[canonical(m[1])] != m[2]:
                changed.append(f"{m[1]} {m[2]} -> {have[canonical(m[1])]}")
                line = f"{m[1]}=={have[canonical(m[1])]}{line[m.end():]}"
            lines.append(line)
    with open(gpu_pins, "w") as f:
        f.writelines(lines)
    return changed + [f"{name} dropped" for name in dropped]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["check"]:
        pins, have = read_pins(LOCK), installed()
        off, absent = differences(pins, have), sorted(set(pins) - set(have))
        for name, version in off.items():
            print(f"{name}: {version} installed, the lock has {pins[name]}")
        print(f"{len(pins) - len(off) - len(absent)} of the lock's {len(pins)} packages at its version"
              + (f"; {len(off)} differ: make setup installs the lock's" if off else "")
              + (f"; {len(absent)} not installed ({', '.join(absent)}): an extra this environment lacks, or make "
                 f"setup installs them" if absent else ""))
        return 1 if off else 0
    if argv == ["write"]:
        try:
            changes = write_lock()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        changed = [c for c in changes if not c.endswith(" dropped")]
        print(f"wrote {LOCK}; {GPU_PINS}: " + ("; ".join(changed) or "unchanged")
              + "".join(f"; the lock's {c}" for c in changes if c.endswith(" dropped")))
        if changed:
            print("the GPU's pins changed: run bench/gpu/run.sh on the next GPU loan (BENCHMARKS.md)")
        return 0
    print("usage: python -m pipeline.constraints check|write", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
