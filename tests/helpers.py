"""Test helpers shared by test modules (import with ``from helpers import ...``; pytest puts tests/ on sys.path).

``make_shard_dir`` writes a small but real shard directory (random documents packed by the real ``Packer``, real
masking plans and MAGNET spans from ``make_sample``, real tar shards with ``.idx.npy`` sidecars and the manifests
``load_index`` reads) without a tokenizer or input files, so loader and trainer tests don't depend on data prep.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading

import numpy as np
import torch
import warm

from pipeline.constraints import canonical  # noqa: F401  (the tests' too)
from pipeline.data.format.index import MANIFEST, job_manifest_name, settings_fingerprint
from pipeline.data.format.sample import FORMAT_VERSION
from pipeline.data.format.tar_shard import ShardWriter
from pipeline.data.loading.batch import Batch, collate
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.data.prep.packing import Packer
from pipeline.data.prep.units import unit_sample
from pipeline.io import write_json_atomic
from pipeline.model.build import build_model, model_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO, "launch", "train.py")
PAD, BOS, EOS, MASK = 0, 1, 2, 3
SPECIAL_IDS = (PAD, BOS, EOS, MASK)


def make_shard_dir(root: str, num_samples: int = 37, seq_len: int = 32, vocab: int = 64,
                   samples_per_shard: int = 13, seed: int = 0, tokenizer_fingerprint: str = "test-tokenizer") -> str:
    """Build ``root/shards`` with exactly ``num_samples`` samples over ceil(num_samples / samples_per_shard)
    shards, written as one complete prep job; returns the directory. Special ids are PAD=0, BOS=1, EOS=2,
    MASK=3; document tokens are drawn from [4, vocab). Documents are 1..2*seq_len tokens long, so samples hold
    several documents and documents cross sample boundaries. ``seed`` changes the tokens and the fingerprint."""
    directory = os.path.join(str(root), "shards")
    os.makedirs(directory, exist_ok=True)
    settings = {"seq_len": seq_len, "seed": seed,
                "tokenizer": {"fingerprint": tokenizer_fingerprint, "vocab_size": vocab, "pad_id": PAD,
                              "bos_id": BOS, "eos_id": EOS, "mask_id": MASK}}
    fingerprint = settings_fingerprint(settings)
    rng = np.random.default_rng(seed)
    plan = PlanSettings(seed=seed, special_ids=np.array(SPECIAL_IDS), span_min=2, span_max=6)
    packer = Packer(seq_len, PAD, BOS, EOS, "drop")
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    while len(packed) < num_samples:
        packed += packer.add(rng.integers(len(SPECIAL_IDS), vocab, size=int(rng.integers(1, 2 * seq_len))).tolist())
    shards = []
    for first in range(0, num_samples, samples_per_shard):
        writer = ShardWriter(os.path.join(directory, f"shard-00000-{first // samples_per_shard:06d}.tar"))
        for i in range(first, min(first + samples_per_shard, num_samples)):
            writer.write(make_sample(*packed[i], file_index=0, sample_index=i, settings=plan))
        shards.append(writer.close())
    write_json_atomic(os.path.join(directory, MANIFEST), {"format": FORMAT_VERSION, "fingerprint": fingerprint,
                                                          "settings": settings, "num_jobs": 1})
    write_json_atomic(os.path.join(directory, job_manifest_name(0)),
                      {"format": FORMAT_VERSION, "fingerprint": fingerprint, "complete": True, "shards": shards})
    return directory


def packed_text_batch(tokenizer, texts: list[str], seq_len: int = 32, rows: int = 4, seed: int = 0,
                      span_fraction: float = 0.3) -> Batch:
    """The last ``rows`` samples of ``texts`` packed as data prep packs them (BOS/EOS, documents crossing sample
    boundaries, the last sample padded), with real masking plans and MAGNET spans of 2..6 tokens."""
    packer = Packer(seq_len, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, "pad")
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    for ids in tokenizer.encode_batch(texts):
        packed += packer.add(ids)
    packed += packer.finish()
    plan = PlanSettings(seed=seed, special_ids=np.array(tokenizer.special_ids), span_min=2, span_max=6,
                        span_fraction=span_fraction)
    return collate([make_sample(ids, segs, 0, i, plan) for i, (ids, segs) in enumerate(packed)][-rows:])


def unit_text_batch(tokenizer, texts: list[str], seq_len: int = 32, seed: int = 0, first_index: int = 0,
                    paraphrases: list[str] | None = None) -> Batch:
    """One sentence unit per sample, as data prep's unit mode writes them (``units.unit_sample``: BOS, the text's
    tokens cut to fit, EOS, padding; one segment), with real masking plans, no spans, and the ``paraphrases`` when
    given. Sample indices (keys) start at ``first_index``."""
    plan = PlanSettings(seed=seed, special_ids=np.array(tokenizer.special_ids), span_fraction=0.0)
    info = (seq_len, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
    para = tokenizer.encode_batch(paraphrases) if paraphrases is not None else [None] * len(texts)
    samples = []
    for i, (ids, p) in enumerate(zip(tokenizer.encode_batch(texts), para)):
        input_ids, n, _ = unit_sample(ids, *info)
        samples.append(make_sample(input_ids, np.array([[0, n]], dtype=np.int32), 0, first_index + i, plan,
                                   None if p is None else unit_sample(p, *info)[0]))
    return collate(samples)


# Run in a fresh interpreter by ``plain_transformers_hidden``: transformers alone, the project made unimportable.
PLAIN_LOAD = """
import json, sys
sys.modules["pipeline"] = None  # an editable install would otherwise make the project importable
import torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1]).eval()
ids, mask = json.loads(sys.argv[2])
with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
print(json.dumps({"hidden": out.tolist(), "class": type(model).__name__}))
"""


def plain_transformers_hidden(hf_dir: str, ids: list[list[int]], mask: list[list[int]]) -> tuple[np.ndarray, str]:
    """(last hidden states, model class) of ``AutoModel.from_pretrained(hf_dir)`` in a fresh process that has
    transformers but not the project (no PYTHONPATH, cwd outside the repository, ``pipeline`` unimportable)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, hf_dir, json.dumps([ids, mask])], capture_output=True,
                          text=True, env=env, cwd=os.path.dirname(os.path.abspath(hf_dir)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return np.asarray(out["hidden"], dtype=np.float32), out["class"]


@contextlib.contextmanager
def rendezvous(world: int = 1):
    """The environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, ...) of ``world`` ranks joining a torch.distributed
    rendezvous whose port no other process can take: a TCPStore in this process binds port 0, so the OS picks the
    port in the bind itself, and the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE, as torchrun's workers
    join its agent's store). A port probed free and bound seconds later by rank 0 was lost under load now and then
    (EADDRINUSE). The store lives until the block ends: launch and wait for the ranks inside it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def join_rendezvous(rank: int, env: dict[str, str]) -> None:
    """In a rank started by ``torch.multiprocessing.spawn``: the gloo process group of :func:`rendezvous`'s ``env``."""
    import torch.distributed as dist

    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=int(env["WORLD_SIZE"]))


def one_rank_env(env: dict[str, str]) -> dict[str, str]:
    """``os.environ`` with :func:`rendezvous`'s ``env`` as rank 0 of a launcher-less process on DeepSpeed's CPU
    accelerator (the repository on PYTHONPATH, one thread)."""
    return {**os.environ, **env, "RANK": "0", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": REPO}


def tiny_llama(tokenizer, attention_dropout: float = 0.0, seed: int = 0):
    """The "tiny" preset with ``tokenizer``'s vocabulary and seeded weights; ``attention_dropout`` is set on every
    attention layer, as the trainer does."""
    torch.manual_seed(seed)
    model = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id))
    model.config.attention_dropout = attention_dropout
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = attention_dropout
    return model


ZERO3 = os.path.join(REPO, "ds_configs", "zero3.json")
ZERO0 = os.path.join(REPO, "ds_configs", "zero0.json")
ZERO1 = os.path.join(REPO, "ds_configs", "zero1.json")
# The fastest CPU layout (BENCHMARKS.md, "CPU layouts"): one rank with both cores' threads and no ZeRO. The real-model
# runs of the slow suite use it (doubling grad_accum keeps the 2-rank global batch); the 2-rank ZeRO-3 path stays
# tested everywhere else. Under make test's two workers a test has one core: one thread (tests/conftest.py).
ONE_RANK = {"nproc": 1, "ds_config": ZERO0,
            "env": {"OMP_NUM_THREADS": "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"}}


def train_args(run_dir: str, experiment: str | None, *overrides: str, ds_config: str = ZERO3) -> list[str]:
    """The arguments of ``launch/train.py``: the DeepSpeed JSON ``ds_config``, the experiment, ``run_dir`` and the
    ``--set`` overrides."""
    args = ["--config", ds_config, *(["--experiment", experiment] if experiment else [])]
    return args + [arg for item in (f"run_dir={run_dir}", *overrides) for arg in ("--set", item)]


def train_command(run_dir: str, experiment: str | None, *overrides: str, nproc: int = 2,
                  launcher: str = "torchrun", port: int | None = None, ds_config: str = ZERO3) -> list[str]:
    """The command line of ``launch/train.py`` on ``nproc`` CPU ranks under ``torch.distributed.run`` ("torchrun")
    or the ``deepspeed`` command the README gives ("deepspeed"), with the DeepSpeed JSON ``ds_config``. The
    rendezvous: ``port`` where given (the ``deepspeed`` command needs one: see :func:`launch_training`), else
    torchrun's ``--standalone`` store, which binds a free port itself."""
    if launcher == "deepspeed":
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc),
               "--master_port", str(port)]
    else:
        where = f"--master_port={port}" if port else "--standalone"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", where]
    return [*cmd, TRAIN_SCRIPT, *train_args(run_dir, experiment, *overrides, ds_config=ds_config)]


def cpu_env(env: dict | None = None) -> dict:
    """The environment of a CPU training launch: DeepSpeed's CPU accelerator, one thread a rank."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}


@contextlib.contextmanager
def training_launch(run_dir: str, experiment: str | None, *overrides: str, nproc: int = 2,
                    env: dict | None = None, launcher: str = "torchrun", port: int | None = None,
                    ds_config: str = ZERO3):
    """(command, environment) of ``launch/train.py`` (:func:`train_command`), valid inside the block: the
    ``deepspeed`` command without a ``port`` gets :func:`rendezvous`'s, held until the block ends."""
    with contextlib.ExitStack() as stack:
        rdzv = {}
        if launcher == "deepspeed" and port is None:
            rdzv = stack.enter_context(rendezvous(nproc))
            port = int(rdzv["MASTER_PORT"])
        yield (train_command(run_dir, experiment, *overrides, nproc=nproc, launcher=launcher, port=port,
                             ds_config=ds_config), cpu_env({**rdzv, **(env or {})}))


def launch_training(run_dir: str, experiment: str | None, *overrides: str, nproc: int = 2, env: dict | None = None,
                    check: bool = True, launcher: str | None = None, port: int | None = None,
                    ds_config: str = ZERO3) -> subprocess.CompletedProcess:
    """``launch/train.py`` on ``nproc`` CPU ranks (gloo, DeepSpeed's CPU accelerator), with ZeRO-3 unless
    ``ds_config`` names another JSON; raises with the output's tail when it fails and ``check``. The ranks are
    forked from a warm process (``launcher="warm"``, :mod:`warm`: torchrun's rank environment without ~10 CPU
    seconds of imports a launch) unless the test is about a launcher: "torchrun" or "deepspeed" start the real one
    (:func:`training_launch`). ``PIPELINE_TEST_LAUNCHER=torchrun`` starts every default launch with torchrun."""
    launcher = launcher or os.environ.get("PIPELINE_TEST_LAUNCHER", "warm")
    if launcher == "warm":
        proc = warm.run(TRAIN_SCRIPT, train_args(run_dir, experiment, *overrides, ds_config=ds_config), nproc=nproc,
                        env=cpu_env(env))
    else:
        with training_launch(run_dir, experiment, *overrides, nproc=nproc, env=env, launcher=launcher, port=port,
                             ds_config=ds_config) as (cmd, launch_env):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=launch_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (ended, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def one_error(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The run failed with exactly one ``prefix:`` line and no traceback of ours; returns the line."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prefix}:")]
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


@contextlib.contextmanager
def in_process_entry():
    """``pipeline.train.entry.main`` callable in this process as one launcher-less rank (RANK, WORLD_SIZE set, so
    it does not set them for later tests); the stop signals' handlers it installs are restored (its threads end as
    it returns)."""
    from pipeline.train.entry import main
    from pipeline.train.signals import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        yield main
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def logged_steps(run_dir: str) -> dict[int, dict]:
    """Step -> the scalars logged in ``metrics.jsonl``; a step logged twice (replayed after a resume) keeps its last."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def loss_and_grads(objective, model, batch: Batch) -> tuple[float, int, dict[str, torch.Tensor]]:
    """(summed loss, target count, parameter gradients) of one objective step: what a rank contributes, for
    comparing a sharded contrastive step with the single-process one."""
    out = objective(model, batch)[objective.name]
    out.loss_sum.backward()
    return out.loss_sum.item(), int(out.num_targets), {n: p.grad.clone() for n, p in model.named_parameters()
                                                      if p.grad is not None}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the server's directory; with ``server.drop`` set to a path, the first GET of it gets half the bytes
    and a closed connection (a dropped transfer). ``server.gets`` counts the GETs of each path."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.gets[self.path] = self.server.gets.get(self.path, 0) + 1
        if self.path != self.server.drop:
            return super().do_GET()
        self.server.drop = None
        with open(self.translate_path(self.path), "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.close_connection = True


@contextlib.contextmanager
def http_server(directory: str, drop: str | None = None):
    """A loopback HTTP server of ``directory`` in a thread, for the block; yields it (``server.url`` is its base)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=directory))
    server.drop, server.gets = drop, {}
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def image_without(hidden: set[str], directory) -> str:
    """This venv's site-packages less the distributions ``hidden``, as links in ``directory``."""
    site = sysconfig.get_paths()["purelib"]
    drop = set()
    for dist in importlib.metadata.distributions(path=[site]):
        if canonical(dist.metadata["Name"]) in hidden:
            drop |= {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}
    directory.mkdir()
    for entry in set(os.listdir(site)) - drop:
        os.symlink(os.path.join(site, entry), directory / entry)
    return str(directory)


def venv_without(hidden: set[str], root) -> tuple[str, str]:
    """(python, its site-packages) of a new venv in ``root`` that sees this venv's packages less the distributions
    ``hidden`` (:func:`image_without`): e.g. the project's own editable install, or what a GPU image lacks."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(site, "image.pth"), "w") as f:
        f.write(image_without(hidden, root / "image") + "\n")
    return python, site
