"""Each query's hard negatives from embeddings, with sentence-transformers' ``mine_hard_negatives`` semantics (6.x,
``util/hard_negatives.py``, ``sampling_strategy="top"``, ``output_format="n-tuple"``), so a user of that library gets
the negatives it would choose:

- candidates: the ``range_max + max_positives + 1`` corpus documents nearest to the query by cosine (exact
  ``torch.topk``, the query rows cut into blocks of at most ``scores_per_block`` scores, so memory stays bounded;
  or, ``use_faiss``, faiss' exact ``IndexFlatIP`` on the unit rows, ``faiss_batch_size`` queries a search, as
  ``mine_hard_negatives(use_faiss=True)``: the same neighbours up to ties and float rounding);
- never a negative: the query's own text, and any positive of the query (a query that repeats over rows has them
  all), nor a filtered candidate: ``absolute_margin`` (score + margin > the query's lowest positive score),
  ``relative_margin`` (score > lowest positive - |lowest positive| x margin), ``max_score``, ``min_score``;
- of the candidates left, ranked by score, ranks ``range_min`` .. ``range_max`` are the window, and the first
  ``num_negatives`` of it are the negatives; a query with fewer has none (n-tuple: the row is dropped).

Scores are computed as sentence-transformers computes them (``cos_sim``: rows normalised again, then one matrix
product; ``pairwise_cos_sim`` for the positives), so equal embeddings give equal scores, bit for bit, and equal
ties. ``range_max`` left out is its default: ``range_min + num_negatives + max_positives``, or with a margin or
``max_score`` ``range_min + 10 x num_negatives + max_positives``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

SCORES_PER_BLOCK = 1 << 24  # similarity scores held at once (64 MiB of float32)
FAISS_BATCH_SIZE = 16384  # queries a faiss search (sentence-transformers' faiss_batch_size default)
INSTALL = "pip install 'decoder-encoders[mining]'"


class MiningError(ValueError):
    """A mining setting or input that cannot work; the message names the option or file and the fix."""


@dataclass(frozen=True)
class MiningSettings:
    """The filters (sentence-transformers' names) and the search's block size; ``None``: the filter is off."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int | None = None
    relative_margin: float | None = None
    absolute_margin: float | None = None
    max_score: float | None = None
    min_score: float | None = None
    scores_per_block: int = SCORES_PER_BLOCK
    use_faiss: bool = False
    faiss_batch_size: int = FAISS_BATCH_SIZE

    def check(self) -> None:
        """Raise :class:`MiningError` for the first setting out of range (before any model is loaded)."""
        checks = [
            (self.num_negatives >= 1, f"--num-negatives must be >= 1, got {self.num_negatives}"),
            (self.range_min >= 0, f"--range-min must be >= 0 (ranks skipped from the top), got {self.range_min}"),
            (self.range_max is None or self.range_max - self.range_min >= self.num_negatives,
             f"--range-max {self.range_max} leaves {(self.range_max or 0) - self.range_min} candidates after "
             f"--range-min {self.range_min}, fewer than --num-negatives {self.num_negatives}; raise --range-max to "
             f"at least {self.range_min + self.num_negatives} or leave it out"),
            (self.relative_margin is None or 0 <= self.relative_margin < 1,
             f"--relative-margin must be in [0, 1) (a fraction of the positive's score, e.g. 0.05), got "
             f"{self.relative_margin}"),
            (self.absolute_margin is None or 0 <= self.absolute_margin <= 2,
             f"--absolute-margin must be in [0, 2] (a cosine difference), got {self.absolute_margin}"),
            (self.max_score is None or -1 <= self.max_score <= 1,
             f"--max-score must be a cosine in [-1, 1], got {self.max_score}"),
            (self.min_score is None or -1 <= self.min_score <= 1,
             f"--min-score must be a cosine in [-1, 1], got {self.min_score}"),
            (None in (self.min_score, self.max_score) or self.min_score < self.max_score,
             f"--min-score {self.min_score} must be below --max-score {self.max_score}"),
            (self.scores_per_block >= 1, f"--scores-per-block must be >= 1, got {self.scores_per_block}"),
            (self.faiss_batch_size >= 1, f"--faiss-batch-size must be >= 1, got {self.faiss_batch_size}"),
        ]
        for ok, message in checks:
            if not ok:
                raise MiningError(message)

    def window_end(self, max_positives: int) -> int:
        """``range_max``, or sentence-transformers' default for a query with up to ``max_positives`` rows."""
        if self.range_max is not None:
            return self.range_max
        filtered = (self.absolute_margin, self.relative_margin, self.max_score) != (None, None, None)
        return self.range_min + self.num_negatives * (10 if filtered else 1) + max_positives


@dataclass
class Mined:
    """Per query: the negatives' corpus indices and scores (``[Q, num_negatives]``, -1 / -inf where too few passed),
    the lowest positive score, and how many candidates each filter removed."""

    indices: torch.Tensor
    scores: torch.Tensor
    positive_scores: torch.Tensor
    skipped: dict[str, int]

    @property
    def complete(self) -> torch.Tensor:
        """Queries with all their negatives (the rows sentence-transformers' n-tuple output keeps)."""
        return torch.isfinite(self.scores).all(1)


def import_faiss():
    """faiss, or :class:`MiningError` naming the install (an optional extra: the torch search needs nothing)."""
    try:
        import faiss
    except ImportError:
        raise MiningError(f"--use-faiss needs faiss-cpu, which is not installed: {INSTALL} (or pip install "
                          "faiss-cpu), or leave --use-faiss out for the exact torch top-k") from None
    return faiss


def search_name(settings: MiningSettings) -> str:
    """The search, as the record names it (faiss with its version: the ties' order is its own)."""
    if not settings.use_faiss:
        return "exact torch top-k"
    return f"exact faiss IndexFlatIP search (faiss {import_faiss().__version__})"


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows at length 1, as sentence-transformers' ``normalize_embeddings`` (an encoder's output and again in
    ``cos_sim``: each application is kept so the bits match)."""
    return F.normalize(x, p=2, dim=1)


def _lowest_positive(queries: torch.Tensor, corpus: torch.Tensor, positives: list[list[int]]) -> torch.Tensor:
    flat_q = torch.tensor([q for q, ps in enumerate(positives) for _ in ps], dtype=torch.long)
    flat_p = torch.tensor([p for ps in positives for p in ps], dtype=torch.long)
    scores = (unit(queries[flat_q]) * unit(corpus[flat_p])).sum(-1)  # pairwise_cos_sim
    return torch.stack([part.min() for part in scores.split([len(ps) for ps in positives])])


def mine(queries: torch.Tensor, corpus: torch.Tensor, positives: list[list[int]], query_in_corpus: list[int],
         max_positives: int, settings: MiningSettings, progress: bool = False) -> Mined:
    """The negatives of each query (rows of ``queries``, unit length) among ``corpus``'s rows: ``positives[q]``
    are query q's positives (corpus indices, each once), ``query_in_corpus[q]`` its own text's index or -1,
    ``max_positives`` the most rows a query has (sentence-transformers sizes the candidate list by it)."""
    n, k_window = len(corpus), settings.window_end(max_positives)
    wanted = k_window + max_positives + 1
    k = min(wanted, n)
    lowest = _lowest_positive(queries, corpus, positives)
    skipped = {"absolute_margin": 0, "relative_margin": 0, "max_score": 0, "min_score": 0}
    out_idx, out_scores = [], []
    inf = float("inf")
    for start, stop, scores, idx in _nearest(queries, corpus, k, settings, progress):
        if wanted > k:
            scores = torch.cat([scores, scores.new_full((len(scores), wanted - k), -inf)], 1)
            idx = torch.cat([idx, idx.new_full((len(idx), wanted - k), -1)], 1)
        own = torch.tensor(query_in_corpus[start:stop]).unsqueeze(1)
        width = max(len(p) for p in positives[start:stop])
        pos = torch.tensor([p + [-2] * (width - len(p)) for p in positives[start:stop]])
        scores[(idx == -1) | (idx == own) | (idx.unsqueeze(2) == pos.unsqueeze(1)).any(2)] = -inf
        low = lowest[start:stop].unsqueeze(1)
        for name, removed in _filters(settings, scores, low):
            if removed is not None:
                scores[removed] = -inf
                skipped[name] += int(removed.sum())
        top, local = torch.topk(scores, k=k_window, dim=1)
        window = slice(settings.range_min, settings.range_min + settings.num_negatives)
        out_scores.append(top[:, window])
        out_idx.append(idx.gather(1, local)[:, window])
    return Mined(torch.cat(out_idx), torch.cat(out_scores), lowest, skipped)


def _nearest(queries: torch.Tensor, corpus: torch.Tensor, k: int, settings: MiningSettings, progress: bool):
    """(start, stop, scores, indices) of the ``k`` nearest corpus rows to each query of a block, best first."""
    corpus_unit = unit(corpus)
    if settings.use_faiss:
        index = import_faiss().IndexFlatIP(corpus.shape[1])
        index.add(corpus_unit.float().contiguous().numpy())
        block = settings.faiss_batch_size
    else:
        block = max(1, settings.scores_per_block // max(len(corpus), 1))
    for start in tqdm(range(0, len(queries), block), desc="search", disable=not progress, leave=False):
        stop = min(start + block, len(queries))
        if settings.use_faiss:
            scores, idx = index.search(unit(queries[start:stop]).float().contiguous().numpy(), k)
            yield start, stop, torch.from_numpy(scores), torch.from_numpy(idx)
        else:
            yield start, stop, *torch.topk(torch.mm(unit(queries[start:stop]), corpus_unit.T), k=k, dim=1)


def _filters(s: MiningSettings, scores: torch.Tensor, low: torch.Tensor):
    """(name, candidates it removes or None) in sentence-transformers' order; each is evaluated after the previous
    one's removal, so a candidate counts under the first filter that removes it."""
    yield "absolute_margin", None if s.absolute_margin is None else scores + s.absolute_margin > low
    yield "relative_margin", None if s.relative_margin is None else scores > low - low.abs() * s.relative_margin
    yield "max_score", None if s.max_score is None else scores > s.max_score
    yield "min_score", None if s.min_score is None else (scores < s.min_score) & (scores != -float("inf"))
