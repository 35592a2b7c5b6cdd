"""Mine hard negatives for pairs files (``data_prep/mine_negatives.py``; ``pipeline-mine-negatives`` runs the same):

    python data_prep/mine_negatives.py --input 'data/sample/pairs/*.jsonl' --model runs/simcse/hf \\
        --output runs/mined --num-negatives 3 --range-min 2 --relative-margin 0.05 [--shards runs/shards/mined]

Each input file (``build_shards.py --pairs``' rows, or a pair shard directory: the files its manifest names) is mined
on its own: its queries, and as corpus its positives and given negatives, are embedded with the model (this
project's ``encode`` for its exports and plain HF directories, sentence-transformers' ``encode_query`` /
``encode_document`` for a sentence-transformers directory), and each row's ``negative`` becomes the negatives
``negatives.mine`` chose for its query (sentence-transformers' ``mine_hard_negatives`` semantics). A query with
fewer than ``--num-negatives`` that pass the filters loses its rows (the n-tuple output drops them), counted in the
manifest. The rows keep their order and every other field, in ``OUTPUT/<input name>``; ``OUTPUT/mining.json``
records the miner, the model, every setting, the inputs and each file's counts. A file is written whole before the
manifest names it, so a killed run, run again, mines only the files it had not finished. ``--shards DIR`` then
builds pair shards of the mined files (``build_shards.py --pairs --negatives N``): their manifest names the mined
files as inputs, and ``mining.json`` lies beside it. Under ``torchrun --nproc-per-node N`` the texts are encoded
across the ranks (``encode``'s batches) and rank 0 mines and writes, the bytes of one process (:func:`mine_files`).
docs/embedding-recipes.md, "Mining hard negatives".
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from collections.abc import Sequence

import torch

from pipeline.data.format.index import MANIFEST
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.sources import JSONL_SUFFIXES, InputError, RecordStats, input_record, read_objects
from pipeline.eval.encode import MAX_TOKENS
from pipeline.eval.ranks import init_from_env, world
from pipeline.io import fsync_replace, read_json, write_json_atomic
from pipeline.mining.negatives import (
    Mined,
    MiningError,
    MiningSettings,
    import_faiss,
    mine,
    search_name,
    unit,
)

RECORD = "mining.json"
ENCODERS = ("auto", "pipeline", "sentence-transformers")
MINER = "pipeline.mining: sentence-transformers mine_hard_negatives semantics (top, n-tuple)"  # + the search


@dataclasses.dataclass(frozen=True)
class MineConfig:
    """One mining job: inputs, model, the filters, and where the mined pairs (and shards) go."""

    inputs: tuple[str, ...]
    model: str
    output: str
    settings: MiningSettings = MiningSettings()
    encoder: str = "auto"
    query_instruction: str | None = None  # None: the model's default (its record / default prompt); "": none
    document_instruction: str | None = None
    max_length: int = 512
    max_tokens: int = MAX_TOKENS  # this project's encode: padded tokens per batch
    batch_size: int = 32  # sentence-transformers' encode batch; this project's encode batches by tokens
    shards: str = ""
    tokenizer: str = ""
    max_text_tokens: int = 0  # 0: the input shards' width, else 512
    progress: bool = True


@dataclasses.dataclass
class PairsFile:
    path: str
    rows: list[tuple[str, dict]]  # (file:line, row)
    shard_pairs: dict | None = None  # the pair shard directory's settings.pairs it came from


def _strings(value) -> list:
    return [value] if isinstance(value, str) else value if isinstance(value, list) else [None]


def read_pairs(path: str) -> list[tuple[str, dict]]:
    """The rows of a pairs jsonl file; the first bad one is a :class:`MiningError` naming its line."""
    stats = RecordStats()
    rows = []
    for where, _, row in read_objects(path, stats):
        bad = [name for name in ("query", "positive") if not isinstance(row.get(name), str) or not row[name].strip()]
        if "negative" in row and not all(isinstance(t, str) and t.strip() for t in _strings(row["negative"])):
            bad.append("negative")
        if bad:
            raise MiningError(f"{where}: {', '.join(bad)} missing, empty or not text; a pairs row is {{\"query\": "
                              f"str, \"positive\": str, \"negative\"?: str | [str, ...]}}")
        rows.append((where, row))
    if stats.num_bad or not rows:
        raise MiningError(stats.examples[0] if stats.examples else f"{path}: no rows; a pairs file holds one "
                          f"{{\"query\", \"positive\"}} object per line")
    return rows


def expand(inputs: Sequence[str]) -> list[PairsFile]:
    """The pairs files of ``inputs`` (globs of jsonl files, or pair shard directories), read and checked."""
    files = []
    for pattern in inputs:
        if os.path.isfile(os.path.join(pattern, MANIFEST)):
            manifest = read_json(os.path.join(pattern, MANIFEST), "name a pair shard directory or pairs files")
            pairs = manifest["settings"].get("pairs")
            if pairs is None:
                raise MiningError(f"{pattern}: not a pair shard directory (built without --pairs); pass pairs "
                                  "files or a directory of build_shards.py --pairs")
            files += [PairsFile(f["path"], read_pairs(f["path"]), {**pairs, "tokenizer": manifest.get(
                "tokenizer_path", "")}) for f in manifest["input_files"]]
            continue
        matches = sorted([pattern] if os.path.isfile(pattern) else glob.glob(pattern, recursive=True))
        if not matches:
            raise MiningError(f"--input {pattern!r} matches no file; check the path or quote the glob")
        for path in matches:
            if not path.endswith(JSONL_SUFFIXES):
                raise MiningError(f"{path}: pairs are jsonl rows ({', '.join(JSONL_SUFFIXES)})")
            files.append(PairsFile(path, read_pairs(path)))
    names = [os.path.basename(f.path) for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MiningError(f"two inputs are named {twice[0]}; each is written to OUTPUT under its name (and is its "
                          "task): rename one")
    return files


@dataclasses.dataclass
class Task:
    """One file's mining problem in sentence-transformers' terms: unique queries, the deduplicated corpus."""

    queries: list[str]
    corpus: list[str]
    positives: list[list[int]]
    query_in_corpus: list[int]
    max_positives: int

    @classmethod
    def of(cls, rows: list[dict]) -> Task:
        texts = [t for _, r in rows for t in (r["positive"], *_strings(r.get("negative", [])))]
        corpus = list(dict.fromkeys(texts))
        at = {text: i for i, text in enumerate(corpus)}
        queries = list(dict.fromkeys(r["query"] for _, r in rows))
        q_at = {q: i for i, q in enumerate(queries)}
        positives: list[list[int]] = [[] for _ in queries]
        counts = [0] * len(queries)
        for _, r in rows:
            q = q_at[r["query"]]
            counts[q] += 1
            if at[r["positive"]] not in positives[q]:
                positives[q].append(at[r["positive"]])
        return cls(queries, corpus, positives, [at.get(q, -1) for q in queries], max(counts))


class Embedder:
    """Unit-length float32 embeddings of queries and documents with either kind of model."""

    def __init__(self, cfg: MineConfig):
        self.cfg, self.kind = cfg, encoder_kind(cfg.model, cfg.encoder)
        if self.kind == "sentence-transformers":
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(cfg.model, device="cpu" if not torch.cuda.is_available() else None)
        else:
            from pipeline.eval import load_model

            self.model = load_model(cfg.model)

    def __call__(self, texts: list[str], query: bool) -> torch.Tensor | None:
        """Embeddings of ``texts`` as queries or documents; across ranks (this project's ``encode``), rank 0 gets
        them all and the other ranks None."""
        cfg = self.cfg
        instruction = cfg.query_instruction if query else cfg.document_instruction
        if self.kind == "sentence-transformers":
            fn = self.st.encode_query if query else self.st.encode_document
            return torch.as_tensor(fn(texts, batch_size=cfg.batch_size, normalize_embeddings=True,
                                      convert_to_numpy=True, show_progress_bar=cfg.progress, prompt=instruction))
        from pipeline.eval import encode

        out = encode(self.model, texts, instruction=instruction, max_length=cfg.max_length, max_tokens=cfg.max_tokens,
                     progress=cfg.progress and world()[0] == 0, gather="rank0")
        return None if out is None else unit(torch.from_numpy(out))

    def task(self, task: Task) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(queries, corpus) embeddings (None on ranks other than 0). With this project's ``encode`` and one prefix
        for both sides, the corpus and the queries that are not in it go through one length-sorted pass, so a query
        that is also a document (a chain of pairs, a query that is another row's positive) is embedded once, and
        the batches are fuller; sentence-transformers' encoder gets its two calls, as ``mine_hard_negatives``."""
        if self.kind == "sentence-transformers" or self.prefix(query=True) != self.prefix(query=False):
            corpus = self(task.corpus, query=False)
            queries = self(task.queries, query=True)
            return None if corpus is None else (queries, corpus)
        extra = [q for q, i in zip(task.queries, task.query_in_corpus) if i < 0]
        both = self(task.corpus + extra, query=False)
        if both is None:
            return None
        at, n = [], len(task.corpus)
        for i in task.query_in_corpus:
            at.append(i if i >= 0 else n)
            n += i < 0
        return both[at], both[:len(task.corpus)]

    def prefix(self, query: bool) -> str:
        """What this project's ``encode`` puts before a query's or a document's text."""
        from pipeline.eval.encode import query_prefix

        return query_prefix(self.model, self.cfg.query_instruction if query else self.cfg.document_instruction)

    def describe(self) -> dict:
        """The model as the record names it: its path, how it was read, and its record or its prompts."""
        out = {"path": os.path.abspath(self.cfg.model), "encoder": self.kind}
        if self.kind == "sentence-transformers":
            return out | {"prompts": self.st.prompts, "default_prompt_name": self.st.default_prompt_name}
        return out | {"record": dataclasses.asdict(self.model.record), "attention": self.model.attention}


def encoder_kind(path: str, encoder: str) -> str:
    """``auto``: this project's ``encode`` for its exports, runs and plain HF directories; sentence-transformers
    for a directory that has its ``modules.json`` and no record of this project."""
    if encoder != "auto":
        return encoder
    try:
        config = read_json(os.path.join(path, "config.json"))
    except (OSError, ValueError):
        config = {}
    st = os.path.isfile(os.path.join(path, "modules.json"))
    return "sentence-transformers" if st and "decoder_encoders" not in config else "pipeline"


def mine_file(task: Task, embed: Embedder, settings: MiningSettings, progress: bool) -> Mined | None:
    """The file's negatives: embedded across the ranks, searched and filtered once, on rank 0 (None elsewhere)."""
    embedded = embed.task(task)
    if embedded is None:
        return None
    return mine(*embedded, task.positives, task.query_in_corpus, task.max_positives, settings, progress)


def mined_rows(rows: list[tuple[str, dict]], task: Task, mined: Mined) -> list[dict]:
    """The rows whose query found all its negatives, in order, each with ``negative`` the mined list."""
    q_at = {q: i for i, q in enumerate(task.queries)}
    complete, idx = mined.complete.tolist(), mined.indices.tolist()
    return [{**r, "negative": [task.corpus[i] for i in idx[q_at[r["query"]]]]}
            for _, r in rows if complete[q_at[r["query"]]]]


def write_rows(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    fsync_replace(tmp, path)


def record_of(cfg: MineConfig, files: list[PairsFile]) -> dict:
    """What fixes the mined bytes (the model's path and every setting; the inputs' sizes and times)."""
    settings = dataclasses.asdict(cfg.settings)
    settings |= {"query_instruction": cfg.query_instruction, "document_instruction": cfg.document_instruction,
                 "max_length": cfg.max_length, "max_tokens": cfg.max_tokens, "encoder": cfg.encoder, "sampling_strategy": "top",
                 "output_format": "n-tuple"}
    return {"miner": f"{MINER}, {search_name(cfg.settings)}", "model": os.path.abspath(cfg.model),
            "settings": settings, "inputs": [input_record(f.path) for f in files]}


def _done(cfg: MineConfig, files: list[PairsFile]) -> dict:
    """``OUTPUT/mining.json`` as far as it goes, or a new record; a different record there is refused."""
    os.makedirs(cfg.output, exist_ok=True)
    path, record = os.path.join(cfg.output, RECORD), record_of(cfg, files)
    done = read_json(path) if os.path.exists(path) else {**record, "files": {}}
    if {k: done.get(k) for k in record} != record:
        diff = [k for k in record if done.get(k) != record[k]]
        raise MiningError(f"{path}: {cfg.output} was mined with another {', '.join(diff)}; use a new --output, or "
                          "delete it to mine again with these settings")
    return done


def mine_files(cfg: MineConfig, files: list[PairsFile]) -> dict:
    """Mine every file not yet in ``OUTPUT/mining.json`` (a different record there is refused), and return it.

    Across ranks (a process group, :func:`main` under ``torchrun``): rank 0 reads the record and tells the others
    what is left; every rank encodes its share of each file's texts (``encode``'s batches, gathered on rank 0, bit
    for bit those of one process), and rank 0 alone searches, filters and writes, so the bytes are one process's."""
    rank, size = world()
    done, error = None, None
    if rank == 0:
        try:
            done = _done(cfg, files)
        except MiningError as e:
            error = e
    if size > 1:
        shared = [done, error]
        torch.distributed.broadcast_object_list(shared, src=0)
        done, error = shared
    if error is not None:
        raise error
    todo = [f for f in files if os.path.basename(f.path) not in done["files"]]
    if not todo:
        if rank == 0:
            print(f"{cfg.output}: every file is mined already")
        return done
    embed = Embedder(cfg)
    done["model_read"] = embed.describe()
    for f in todo:
        task = Task.of(f.rows)
        mined = mine_file(task, embed, cfg.settings, cfg.progress)
        if mined is None:  # another rank's share is encoded; rank 0 writes
            continue
        rows = mined_rows(f.rows, task, mined)
        name = os.path.basename(f.path)
        write_rows(os.path.join(cfg.output, name), rows)
        done["files"][name] = {"rows": len(f.rows), "kept": len(rows), "queries": len(task.queries),
                               "corpus": len(task.corpus), "queries_short": int((~mined.complete).sum()),
                               "skipped": mined.skipped}
        write_json_atomic(os.path.join(cfg.output, RECORD), done)
        print(f"{name}: {len(rows)} of {len(f.rows)} rows with {cfg.settings.num_negatives} negatives "
              f"({len(task.queries)} queries, corpus {len(task.corpus)}; skipped {mined.skipped})")
    return done


def build_mined_shards(cfg: MineConfig, files: list[PairsFile], record: dict) -> None:
    """Pair shards of the mined files, in the input shards' layout where they came from a shard directory, with the
    mining record beside their manifest (whose inputs are the mined files)."""
    pairs = next((f.shard_pairs for f in files if f.shard_pairs), None) or {}
    instructions = ""
    if pairs.get("instructions"):
        instructions = os.path.join(cfg.output, "instructions.json")
        write_json_atomic(instructions, pairs["instructions"])
    mined = tuple(os.path.join(cfg.output, os.path.basename(f.path)) for f in files)
    build = BuildConfig(inputs=mined, tokenizer=cfg.tokenizer or pairs.get("tokenizer", ""), output=cfg.shards,
                        seq_len=cfg.max_text_tokens or pairs.get("width", 512), pairs=True,
                        negatives=cfg.settings.num_negatives, instructions=instructions,
                        instruction_format=pairs.get("instruction_format", BuildConfig.instruction_format),
                        progress=cfg.progress)
    run_job(build)
    write_json_atomic(os.path.join(cfg.shards, RECORD), record)


def parse_args(argv: list[str] | None = None) -> MineConfig:
    d, s = MineConfig((), "", ""), MiningSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="GLOB|DIR",
                   help="pairs jsonl files (globs, quoted) or pair shard directories (the files they were built from)")
    p.add_argument("--model", required=True, help="an export, run directory, HF or sentence-transformers directory")
    p.add_argument("--output", required=True, help="directory of the mined pairs files and mining.json")
    p.add_argument("--encoder", choices=ENCODERS, default=d.encoder,
                   help="how to embed: this project's encode, or sentence-transformers (auto: by the directory)")
    f = p.add_argument_group("filters (sentence-transformers' mine_hard_negatives names)")
    f.add_argument("--num-negatives", type=int, default=s.num_negatives, help="negatives per row (num_negatives)")
    f.add_argument("--range-min", type=int, default=s.range_min, help="nearest candidates skipped (range_min)")
    f.add_argument("--range-max", type=int, default=None, help="candidates considered (range_max)")
    f.add_argument("--relative-margin", type=float, default=None,
                   help="drop candidates above positive - |positive| x this (relative_margin, NV-Retriever: 0.05)")
    f.add_argument("--absolute-margin", type=float, default=None,
                   help="drop candidates above positive - this (absolute_margin)")
    f.add_argument("--max-score", type=float, default=None, help="drop candidates above this cosine (max_score)")
    f.add_argument("--min-score", type=float, default=None, help="drop candidates below this cosine (min_score)")
    f.add_argument("--scores-per-block", type=int, default=s.scores_per_block,
                   help="similarity scores computed at once (memory: 4 bytes each)")
    f.add_argument("--use-faiss", action="store_true",
                   help="search with faiss' exact IndexFlatIP (use_faiss; the mining extra: faiss-cpu)")
    f.add_argument("--faiss-batch-size", type=int, default=s.faiss_batch_size,
                   help="queries a faiss search (faiss_batch_size)")
    e = p.add_argument_group("embedding")
    e.add_argument("--query-instruction", default=None,
                   help="queries' instruction (default: the model's own; '' for none): sentence-transformers' "
                        "query_prompt, formatted by an export of this project as it was trained")
    e.add_argument("--document-instruction", default=None, help="the corpus's (corpus_prompt)")
    e.add_argument("--max-length", type=int, default=d.max_length, help="tokens a text is cut to (this project)")
    e.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="padded tokens per batch (this project's encode; the batches, and so the bits, depend on it)")
    e.add_argument("--batch-size", type=int, default=d.batch_size, help="texts a batch (sentence-transformers)")
    b = p.add_argument_group("pair shards of the mined rows (build_shards.py --pairs)")
    b.add_argument("--shards", default="", help="also build pair shards of the mined files here")
    b.add_argument("--tokenizer", default="", help="their tokenizer (default: the input shard directory's)")
    b.add_argument("--max-text-tokens", type=int, default=0, help="their width (default: the input shards', or 512)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    a = p.parse_args(argv)
    settings = MiningSettings(a.num_negatives, a.range_min, a.range_max, a.relative_margin, a.absolute_margin,
                              a.max_score, a.min_score, a.scores_per_block, a.use_faiss, a.faiss_batch_size)
    return MineConfig(tuple(a.input), a.model, a.output, settings, a.encoder, a.query_instruction,
                      a.document_instruction, a.max_length, a.max_tokens, a.batch_size, a.shards, a.tokenizer, a.max_text_tokens,
                      a.progress)


def check(cfg: MineConfig) -> list[PairsFile]:
    """Every setting and input, before a model is loaded: :class:`MiningError` names the first problem."""
    cfg.settings.check()
    if cfg.settings.use_faiss:
        import_faiss()
    files = expand(cfg.inputs)
    for ok, message in [
        (cfg.max_length >= 1, f"--max-length must be >= 1, got {cfg.max_length}"),
        (cfg.max_tokens >= 1, f"--max-tokens must be >= 1, got {cfg.max_tokens}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (os.path.isdir(cfg.model), f"--model {cfg.model}: no such directory; name an export, run or "
                                   "sentence-transformers directory"),
    ]:
        if not ok:
            raise MiningError(message)
    if cfg.shards and not (cfg.tokenizer or any(f.shard_pairs for f in files)):
        raise MiningError("--shards needs --tokenizer (the input is no pair shard directory that names one)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and encoder_kind(cfg.model, cfg.encoder) != "pipeline":
        raise MiningError(f"--model {cfg.model} is read with sentence-transformers' encoder, which runs on one "
                          "process: launch without torchrun, or pass --encoder pipeline (this project's encode, "
                          "split over the ranks)")
    return files


def main(argv: list[str] | None = None) -> int:
    """The command; under ``torchrun --nproc-per-node N`` the texts are encoded across the N ranks (CPU, gloo) and
    rank 0 mines and writes what one process would."""
    cfg = parse_args(argv)
    try:
        files = check(cfg)
    except MiningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_from_env("cpu")
    try:
        record = mine_files(cfg, files)
        if cfg.shards and world()[0] == 0:
            build_mined_shards(cfg, files, record)
    except (MiningError, BuildError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if world()[1] > 1:
        torch.distributed.destroy_process_group()
    return 0

