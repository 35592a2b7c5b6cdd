"""Drive the real SLURM cluster of ``tests/slurm/cluster.sh`` from tests: start and stop it, submit batch jobs,
wait for job states, signal and requeue jobs. Every call goes through the real client commands (sbatch, scontrol,
scancel), so what the tests see is what a user sees.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.sh")
PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged")
PORT_ATTEMPTS = 3
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


def missing_packages() -> list[str]:
    return [p for p in PACKAGES if shutil.which(p) is None]


def _ports_free(first: int, count: int) -> bool:
    for port in range(first, first + count):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
    return True


def _free_port_base(nodes: int) -> int:
    """A block of free ports (slurmctld + one per slurmd), random so that test sessions running side by side on
    one machine (several engineers, one CI box) get their own cluster."""
    for _ in range(100):
        base = random.randrange(17000, 19990, 10)
        if _ports_free(base, nodes + 1):
            return base
    raise RuntimeError("no free block of ports in 17000-19999 for the test SLURM cluster")


@dataclass
class Cluster:
    directory: str
    env: dict[str, str]  # SLURM_CONF for the client commands; jobs inherit it from sbatch

    @classmethod
    def start(cls, directory: str, nodes: int = 2) -> Cluster:
        """Bring up slurmctld and ``nodes`` slurmds (n1..nN). Job ids start at a value tied to the port block, so
        jobs of clusters running side by side get different ids, hence different MASTER_PORTs. The daemons bind
        ports found free a moment before, which another process may take meanwhile: then another block is tried."""
        for _ in range(PORT_ATTEMPTS):
            base = _free_port_base(nodes)
            env = {**os.environ, "NNODES": str(nodes), "PORT_BASE": str(base),
                   "FIRST_JOB_ID": str((base - 16990) * 10)}
            proc = subprocess.run(["bash", SCRIPT, "up", directory], env=env, capture_output=True, text=True,
                                  timeout=120)
            cluster = cls(directory, {**os.environ, "SLURM_CONF": os.path.join(directory, "slurm.conf")})
            if proc.returncode == 0:
                return cluster
            cluster.stop()
            if "Address already in use" not in proc.stdout + proc.stderr:
                break
        raise RuntimeError(f"tests/slurm/cluster.sh up {directory} failed:\n{proc.stdout}\n{proc.stderr}")

    def stop(self) -> None:
        subprocess.run(["bash", SCRIPT, "down", self.directory], env=self.env, capture_output=True, timeout=120)

    def command(self, *args: str) -> str:
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: str, *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None,
               cwd: str | None = None) -> int:
        """Submit ``script args`` with sbatch ``options``; the job's environment is ``env`` on top of ours."""
        proc = subprocess.run(["sbatch", "--parsable", *options, script, *args], env={**self.env, **(env or {})},
                              cwd=cwd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def jobs(self, job_id: int) -> list[dict[str, str]]:
        """``scontrol show job`` records of a job (one per task of an array job), as key -> value."""
        out = self.command("scontrol", "show", "job", "--oneliner", str(job_id))
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def job(self, job_id: int) -> dict[str, str]:
        (record,) = self.jobs(job_id)
        return record

    def wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.5)

    def wait_finished(self, job_id: int, timeout: float = 600) -> list[dict[str, str]]:
        """Wait until every task of the job is in a final state; returns their records."""
        self.wait(f"job {job_id} to finish", lambda: all(j["JobState"] in FINISHED for j in self.jobs(job_id)),
                  timeout)
        return self.jobs(job_id)

    def daemon_log(self, job_id: int) -> str:
        """The slurmctld and slurmd log lines about a job: why it failed when its own output says nothing."""
        pattern = re.compile(rf"\b{job_id}\b")
        log_dir = os.path.join(self.directory, "log")
        lines = []
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                lines += [f"{name}: {line.rstrip()}" for line in f if pattern.search(line)]
        return "\n".join(lines)

    def signal(self, job_id: int, signal: str, batch: bool = True) -> None:
        """``scancel [--batch] --signal=SIG``: with ``batch`` only the batch shell gets it, as with --signal=B:."""
        self.command("scancel", *(["--batch"] if batch else []), f"--signal={signal}", str(job_id))

    def requeue(self, job_id: int) -> None:
        """``scontrol requeue`` a finished job. SLURM starts it at its BeginTime (about cred_expire = 10 s later):
        forcing ``StartTime=now`` raced slurmd's revocation of the job's old credential (a launch in the second
        the job ended is refused, "Job credential revoked", and the job ends FAILED without running)."""
        self.command("scontrol", "requeue", str(job_id))
        self.wait(f"job {job_id} to be pending", lambda: self.job(job_id)["JobState"] == "PENDING", 30)
