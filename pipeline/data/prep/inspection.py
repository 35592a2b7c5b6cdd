"""Verify a shard directory against its manifests, print its statistics and show one sample as text:

    python data_prep/inspect_shards.py shards/ --sample 0 --ratio 0.3 --policy 80-10-10

(or ``pipeline-inspect-shards ...``).

Verification reads every shard: file size and sha256 against the job manifests, every sample decodable and valid
(``Sample.validate``: dtypes, shapes, segments and spans in bounds, spans inside one document), the masking plan a
permutation of the maskable tokens that skips every special token, and each input file's samples complete. Any
problem ends with a non-zero exit status and a message naming the shard and sample. See docs/data_prep.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.data.format.index import INDEX, DatasetIndex, load_index
from pipeline.data.format.masking import POLICIES, apply_mask_plan
from pipeline.data.format.remote import is_url
from pipeline.data.format.sample import UNMASKABLE, Sample, parse_key
from pipeline.data.format.tar_shard import ShardReader, sha256_file
from pipeline.io import read_json
from pipeline.tokenizer import load_tokenizer


class ShardProblem(ValueError):
    pass


@dataclass
class Stats:
    samples: int = 0
    tokens: int = 0
    pieces: int = 0
    maskable: int = 0
    masked: int = 0
    span_tokens: int = 0

    def add(self, sample: Sample, ratio: float) -> None:
        lengths = sample.segments[:, 1] - sample.segments[:, 0]
        maskable = 0 if sample.mask_rank is None else int((sample.mask_rank != UNMASKABLE).sum())
        self.samples += 1
        self.tokens += int(lengths.sum())
        self.pieces += len(lengths)
        self.maskable += maskable
        self.masked += int(np.floor(ratio * maskable + 0.5))  # the count masking.mask_targets selects
        self.span_tokens += int((sample.spans[:, 1] - sample.spans[:, 0]).sum())


def check_plan(sample: Sample, special_ids: np.ndarray) -> None:
    """The ranks of the maskable tokens are a permutation of 0..n-1, and no special token or padding is maskable."""
    rank = sample.mask_rank
    if rank is None:  # a pairs sample: no plan (Sample.validate checked its pool spans)
        return
    maskable = rank != UNMASKABLE
    if not np.array_equal(np.sort(rank[maskable]), np.arange(int(maskable.sum()))):
        raise ShardProblem(f"sample {sample.key}: mask ranks are not a permutation of the maskable tokens")
    if (maskable & np.isin(sample.input_ids, special_ids)).any():
        raise ShardProblem(f"sample {sample.key}: a special token is maskable")
    inside = np.zeros(len(rank), dtype=bool)
    for s, e in sample.segments:
        inside[s:e] = True
    if (maskable & ~inside).any():
        raise ShardProblem(f"sample {sample.key}: a padding position is maskable")


def verify(index: DatasetIndex, special_ids: np.ndarray, ratio: float) -> Stats:
    """Check every shard and sample against the job manifests; returns statistics over all samples."""
    stats = Stats()
    expected = {f["file_index"]: f["samples"] for job in index.jobs for f in job["files"]}
    # per input file: the sample indices seen (freed once all are); each source's come in order through its shards
    seen: dict[int, set[int]] = {}
    done: set[int] = set()
    last: dict[tuple[int, str], int] = {}
    for n, shard in enumerate(index.shards):
        where = f"shard {shard.path}"
        if not os.path.exists(shard.path):
            raise ShardProblem(f"{where} is missing; re-run its prep job ({shard.name} names the job)")
        if os.path.getsize(shard.path) != shard.bytes or sha256_file(shard.path) != shard.sha256:
            raise ShardProblem(f"{where}: size or sha256 differs from the job manifest (modified or damaged); "
                               f"delete it and its job manifest entry by rebuilding the job")
        reader = ShardReader(shard.path)
        if len(reader) != shard.samples:
            raise ShardProblem(f"{where}: its index holds {len(reader)} samples, the manifest says {shard.samples}")
        tokens = 0
        for i, sample in enumerate(reader):
            try:
                sample.validate(index.seq_len)
                check_plan(sample, special_ids)
            except ValueError as e:
                raise ShardProblem(f"{where}, sample {i}: {e}") from e
            file_index, sample_index = parse_key(sample.key)
            _check_key(where, i, sample.key, expected.get(file_index, 0), last.get((file_index, shard.source), -1),
                       seen.setdefault(file_index, set()) if file_index not in done else None)
            last[(file_index, shard.source)] = sample_index
            seen[file_index].add(sample_index)
            if len(seen[file_index]) == expected[file_index]:
                del seen[file_index]
                done.add(file_index)
            tokens += int((sample.segments[:, 1] - sample.segments[:, 0]).sum())
            stats.add(sample, ratio)
        reader.close()
        if tokens != shard.tokens:
            raise ShardProblem(f"{where}: {tokens} tokens, the manifest says {shard.tokens}")
        if sys.stderr.isatty():
            print(f"\rverified {n + 1}/{len(index.shards)} shards", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    for job in index.jobs:
        for f in job["files"]:
            held = f["samples"] if f["file_index"] in done else len(seen.get(f["file_index"], ()))
            if held != f["samples"]:
                raise ShardProblem(f"input {f['path']} (file {f['file_index']}): the shards hold "
                                   f"{held} samples, the job manifest says {f['samples']}")
    return stats


def _check_key(where: str, i: int, key: str, expected: int, last: int, seen: set[int] | None) -> None:
    """A sample's key: within its file's count, after the previous sample of its file and source, not seen before
    (``seen`` None: all of the file's samples were seen already)."""
    file_index, sample_index = parse_key(key)
    if sample_index <= last:
        raise ShardProblem(f"{where}, sample {i}: key {key} out of order, after sample {last} of input file "
                           f"{file_index}")
    if seen is None or sample_index >= expected or sample_index in seen:
        raise ShardProblem(f"{where}, sample {i}: key {key} is a duplicate or beyond the {expected} samples the job "
                           f"manifest records for input file {file_index}")


def check_index_file(index: DatasetIndex) -> None:
    path = os.path.join(index.directory, INDEX)
    if not os.path.exists(path):
        return
    names = [s["name"] for s in read_json(path, "delete it; the last prep job rewrites it")["shards"]]
    if names != [s.name for s in index.shards]:
        raise ShardProblem(f"{path} lists other shards than the job manifests; delete it and re-run any prep job "
                           f"(a finished job only rewrites {INDEX})")


def statistics(index: DatasetIndex, stats: Stats | None, ratio: float) -> str:
    """The directory's statistics from its manifests, and from the samples when ``stats`` (of ``verify``) is given."""
    documents = sum(f["documents"] for job in index.jobs for f in job["files"])
    bad: dict[str, int] = {}
    for job in index.jobs:
        for f in job["files"]:
            for reason, count in f["bad_records"].items():
                bad[reason] = bad.get(reason, 0) + count
    s = index.settings
    positions = max(index.num_samples * index.seq_len, 1)
    lines = [f"{index.directory}: {len(index.shards)} shards from {index.num_samples} samples of {index.seq_len} "
             f"tokens, {sum(len(j['files']) for j in index.jobs)} input files, {len(index.jobs)} jobs",
             f"tokens: {index.num_tokens} in documents ({index.num_tokens / positions:.1%} of all positions), "
             f"documents: {documents}, mean document length: {index.num_tokens / max(documents, 1):.1f} tokens "
             "(with BOS/EOS; remainders dropped at file ends)",
             f"bad records skipped: {sum(bad.values())}" + (f" ({bad})" if bad else "")]
    if "source_field" in s:
        lines.append(f"sources (field {s['source_field']!r}, default {s['source_default']!r}): " + ", ".join(
            f"{name} {c['documents']} documents, {c['samples']} samples, {c['tokens']} tokens"
            for name, c in index.source_counts().items()))
    if s.get("units"):
        truncated = sum(f["truncated_units"] for job in index.jobs for f in job["files"])
        paraphrases = f", with paraphrases ({s['paraphrase_field']!r})" if s["paraphrase_field"] else ""
        lines.append(f"units: one {s['units']} a sample{paraphrases}; {truncated} cut to {index.seq_len} tokens")
    if s.get("pairs"):
        p = s["pairs"]
        tasks: dict[str, int] = {}
        for job in index.jobs:
            for f in job["files"]:
                for task, n in f["tasks"].items():
                    tasks[task] = tasks.get(task, 0) + n
        truncated = sum(f["truncated_texts"] for job in index.jobs for f in job["files"])
        lines.append(f"pairs: {p['slots']} texts a row (query, positive, {p['negatives']} negatives) of {p['width']} "
                     f"tokens, instructions joined as {p['instruction_format']!r}; rows per task: {tasks}; "
                     f"{truncated} texts cut")
    if stats is not None:
        spans = "" if s.get("units") or s.get("pairs") else (
            f"; MAGNET span fraction: {stats.span_tokens / max(stats.tokens, 1):.2%} "
            f"(target {s['span_fraction']}, lengths {s['span_min']}-{s['span_max']})")
        lines.append(f"document pieces per sample: {stats.pieces / max(stats.samples, 1):.2f}; masked at ratio "
                     f"{ratio}: {stats.masked / max(stats.maskable, 1):.2%} of maskable tokens, "
                     f"{stats.masked / max(stats.tokens, 1):.2%} of document tokens" + spans)
    return "\n".join(lines)


def token_texts(tok, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, by decoding growing prefixes (keeps the spaces a per-token decode
    would drop)."""
    out, prev = [], ""
    for j in range(1, len(ids) + 1):
        cur = tok.decode(ids[:j])
        common = len(os.path.commonprefix([prev, cur]))
        out.append(cur[common:])
        prev = cur
    return out


def _visible(text: str) -> str:
    """A token's text inside a marker: line breaks and tabs escaped, an empty text (a lone space) as a middle dot."""
    return text.replace("\n", "\\n").replace("\t", "\\t") or "\u00b7"


def render_pairs(sample: Sample, tok) -> str:
    """A pairs sample as text: each slot's instruction (not pooled) and its pooled text as {{...}}."""
    names = ["query", "positive"] + [f"negative {k + 1}" for k in range(len(sample.segments) - 2)]
    lines = []
    for name, (s, e), (a, b), h in zip(names, sample.segments.tolist(), sample.pool_spans.tolist(),
                                       sample.text_hash.tolist()):
        ids = sample.input_ids
        lines.append(f"--- {name}: tokens [{s}, {e}), pooled [{a}, {b}), text hash {h & (2**64 - 1):016x} ---")
        lines.append(f"{tok.decode(ids[s:a].tolist())}{{{{{tok.decode(ids[a:b].tolist())}}}}}"
                     f"{tok.decode(ids[b:e].tolist())}")
    return "\n".join(lines)


def render_sample(sample: Sample, tok, ratio: float, policy: str) -> str:
    """The sample as text, masked targets as [MASK:word] / [RAND:word>new] / [KEEP:word], spans as <<...>>."""
    if sample.pool_spans is not None:
        return render_pairs(sample, tok)
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    mask_id = -1 if tok.mask_id is None else tok.mask_id  # a tokenizer without one (Llama) still shows [MASK:x]
    pool = torch.from_numpy(tok.regular_ids())
    masked, target = apply_mask_plan(ids, torch.from_numpy(sample.mask_rank.astype(np.int32)),
                                     torch.from_numpy(sample.mask_draw.astype(np.int64)), ratio, policy,
                                     mask_id, pool)
    starts = {int(s) for s, _ in sample.spans}
    ends = {int(e) for _, e in sample.spans}
    lines = []
    for n, (s, e) in enumerate(sample.segments.tolist()):
        lines.append(f"--- document piece {n + 1}: tokens [{s}, {e}) ---")
        texts = token_texts(tok, sample.input_ids[s:e].tolist())
        parts = []
        for pos, text in zip(range(s, e), texts):
            if pos in starts:
                parts.append("<<")
            if target[pos]:
                new = int(masked[pos])
                kind = ("MASK" if new == mask_id else "KEEP" if new == int(ids[pos]) else "RAND")
                core = text.lstrip(" ")
                replacement = f">{_visible(tok.decode([new]).strip(' '))}" if kind == "RAND" else ""
                text = f"{text[: len(text) - len(core)]}[{kind}:{_visible(core)}{replacement}]"
            parts.append(text)
            if pos + 1 in ends:
                parts.append(">>")
        lines.append("".join(parts))
    padding = len(sample.input_ids) - int(sample.segments[-1, 1]) if len(sample.segments) else len(sample.input_ids)
    if padding:
        lines.append(f"--- padding: {padding} tokens ---")
    return "\n".join(lines)


def find_sample(index: DatasetIndex, n: int) -> tuple[str, Sample]:
    if not 0 <= n < index.num_samples:
        raise ShardProblem(f"--sample {n} is out of range: the directory holds {index.num_samples} samples")
    for shard in index.shards:
        if n < shard.samples:
            reader = ShardReader(shard.path)
            return f"{shard.name} #{n}", reader[n]
        n -= shard.samples
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="shard directory written by data_prep/build_shards.py")
    p.add_argument("--sample", type=int, default=0, help="global sample number to decode (shards in name order)")
    p.add_argument("--ratio", type=float, default=0.3, help="mask ratio to show and measure")
    p.add_argument("--policy", choices=POLICIES, default="80-10-10", help="mask replacement policy to show")
    p.add_argument("--tokenizer", help="tokenizer to decode with (default: the one recorded in manifest.json)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip reading and checking every shard (statistics from the manifests only)")
    a = p.parse_args(argv)
    try:
        if not 0.0 < a.ratio <= 1.0:
            raise ShardProblem(f"--ratio must be in (0, 1], got {a.ratio}")
        if is_url(a.directory):
            raise ShardProblem(f"{a.directory}: inspect_shards reads a local shard directory; copy it here first")
        index = load_index(a.directory)
        check_index_file(index)
        tok_path = a.tokenizer or index.tokenizer_path
        tok = load_tokenizer(tok_path)
        if tok.info.fingerprint != index.tokenizer["fingerprint"]:
            fix = ("pass the tokenizer the shards were built with" if a.tokenizer else
                   "it changed since the build; pass the tokenizer the shards were built with: --tokenizer DIR")
            raise ShardProblem(f"tokenizer {tok_path} is not the one the shards were built with ({index.tokenizer_path}"
                               f"; fingerprint {tok.info.fingerprint} != {index.tokenizer['fingerprint']}); {fix}")
        stats = verify(index, np.asarray(tok.special_ids), a.ratio) if a.verify else None
        print(statistics(index, stats, a.ratio))
        if index.num_samples:
            where, sample = find_sample(index, a.sample)
            print(f"\nsample {a.sample} = {sample.key} ({where}), mask ratio {a.ratio}, policy {a.policy}; "
                  f"[MASK:x] mask token, [RAND:x>y] random token, [KEEP:x] kept target, <<...>> MAGNET span")
            print(render_sample(sample, tok, a.ratio, a.policy))
    except (ShardProblem, ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.verify:
        print("OK: every shard matches the manifests")
    return 0
