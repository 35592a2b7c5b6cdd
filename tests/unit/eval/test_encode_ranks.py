"""encode() across ranks and its batching: 2 real gloo ranks give the one-process embeddings bit for bit (a row's
embedding moves ~1e-6 with its batch on CPU fp32, so the batches must not depend on the rank count), evaluate.py
under 2 ranks writes the same results as alone, token-budget batches, and the cheaper attention forms of
``row_states`` against the project's mask builder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import join_rendezvous, rendezvous, tiny_llama
from shard_corpus import TOKENIZER

from pipeline.eval import encode, load_model
from pipeline.eval.encode import rows_for
from pipeline.eval.forward import hidden_states, length_batches, pad_id, pad_rows, row_states
from pipeline.eval.runner import main as evaluate_main
from pipeline.tokenizer import load_tokenizer

FIXTURES = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")), "fixtures", "eval")
TEXTS = [("word " * (i % 13)) + f"sentence number {i}." for i in range(23)]
BUDGET = 96  # padded tokens per batch: several batches of different sizes, an odd count for 2 ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    tok = load_tokenizer(TOKENIZER)
    out = str(tmp_path_factory.mktemp("model") / "tiny")
    tiny_llama(tok, seed=1).save_pretrained(out)
    tok.save(out)
    return out


def test_length_batches_fill_the_budget_longest_first():
    lengths = [3, 9, 4, 4, 1, 9, 2]
    batches = length_batches(lengths, max_tokens=18)
    assert batches == [[1, 5], [2, 3, 0, 6], [4]]  # 2 x 9 (a third row: 27), 4 x 4 (a fifth row: 20)
    assert length_batches(lengths, max_tokens=18) == batches  # a function of the lengths alone
    assert length_batches(lengths, max_tokens=5) == [[1], [5], [2], [3], [0], [6, 4]]  # too long: a batch alone
    assert length_batches(lengths, max_rows=3) == [[1, 5, 2], [3, 0, 6], [4]]
    with pytest.raises(ValueError, match="max_tokens 0 / max_rows None: .*pass a positive budget"):
        length_batches(lengths, max_tokens=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_row_states_equal_the_project_mask_on_every_token(hf_dir, implementation, mode):
    """Causal without a mask and bidirectional with a key-padding mask give each token the state the dense
    [B, 1, L, L] mask gives it; padding positions are not compared (never read)."""
    model = load_model(hf_dir, attn_implementation=implementation)
    rows = [ids for ids, _, _ in rows_for(model, TEXTS[:5], "", 64, "bos_eos")]
    pad = pad_id(model.tokenizer)
    with torch.no_grad():
        cheap = row_states(model.lm, rows, pad, mode)
        dense = hidden_states(model.lm, *pad_rows(rows, pad), mode)
    assert len({len(r) for r in rows}) > 1  # padded
    for i, row in enumerate(rows):
        torch.testing.assert_close(cheap[i, :len(row)], dense[i, :len(row)], atol=1e-5, rtol=1e-5)


def _encode_rank(rank: int, rdzv: dict, hf_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_rendezvous(rank, rdzv)
    model = load_model(hf_dir, attention="bidirectional")
    results = {gather: encode(model, TEXTS, "", max_tokens=BUDGET, gather=gather) for gather in ("all", "rank0")}
    np.save(os.path.join(out_dir, f"all{rank}.npy"), results["all"])
    if rank == 0:
        np.save(os.path.join(out_dir, "rank0.npy"), results["rank0"])
    else:
        assert results["rank0"] is None
    dist.destroy_process_group()


def test_two_ranks_encode_bit_equal_to_one_process(hf_dir, tmp_path):
    """The ranks run one thread each (as torchrun's workers), this process its default number."""
    assert len(length_batches([len(t.split()) for t in TEXTS], BUDGET)) > 2
    with rendezvous(2) as rdzv:
        mp.spawn(_encode_rank, args=(rdzv, hf_dir, str(tmp_path)), nprocs=2, join=True)
    alone = encode(load_model(hf_dir, attention="bidirectional"), TEXTS, "", max_tokens=BUDGET)
    for name in ("all0", "all1", "rank0"):
        assert np.array_equal(np.load(tmp_path / f"{name}.npy"), alone), name
    other = encode(load_model(hf_dir, attention="bidirectional"), TEXTS, "", max_tokens=1)  # every row alone
    assert not np.array_equal(other, alone) and np.allclose(other, alone, atol=1e-5)  # why batches are global


def _evaluate_rank(rank: int, rdzv: dict, argv: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update({**rdzv, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    assert evaluate_main(argv) == 0
    dist.destroy_process_group()


def test_evaluate_under_two_ranks_writes_the_results_of_one(hf_dir, tmp_path):
    argv = ["--model", hf_dir, "--tasks", "sts,clustering", "--data-dir", FIXTURES, "--no-progress",
            "--device", "cpu", "--max-tokens", str(BUDGET), "--set", "sts.datasets=[sts/stsb.tsv]"]
    with rendezvous(2) as rdzv:
        mp.spawn(_evaluate_rank, args=(rdzv, argv + ["--out", str(tmp_path / "two.json")]), nprocs=2, join=True)
    assert evaluate_main(argv + ["--out", str(tmp_path / "one.json")]) == 0
    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert two["results"] == one["results"] and two["headline"] == one["headline"]
    assert set(one["results"]) == {"sts", "clustering"}
