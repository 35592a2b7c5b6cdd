"""Echo embeddings (``encode(layout="echo")``, pipeline/eval/echo.py) against a hand-written reference on a real tiny
HF Llama: the row is BOS + the Echo paper's template holding the text twice + EOS, the pooled positions are exactly the
second copy's, and the embedding is the mean of the causal states of those positions computed by hand; with an
instruction, the authors' query template; through launch/evaluate.py's runner and the MTEB encoder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import tiny_llama

from pipeline.eval import encode, load_model
from pipeline.eval.encode import rows_for
from pipeline.eval.runner import main as evaluate_main
from pipeline.experiment import SAMPLE_DIR
from pipeline.tokenizer import load_tokenizer

FIXTURES = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")), "fixtures", "eval")
TEXTS = ["A man plays a guitar.", "Hi", "Two children are reading a book under a large old tree in the park."]
INSTRUCTION = "Retrieve semantically similar text: "  # as encode() gets it: LLM2Vec's "{instruction}: " join


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    tok = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    out = str(tmp_path_factory.mktemp("model") / "tiny")
    tiny_llama(tok, seed=2).save_pretrained(out)
    tok.save(out)
    return out


@pytest.fixture(scope="module")
def model(hf_dir):
    return load_model(hf_dir)


def by_hand(model, text: str, instruction: str = "") -> tuple[list[int], int]:
    """(the row, where the second copy starts), written out: the template's string, tokenized as one, between BOS
    and EOS; the sample tokenizer (sentencepiece) gives a word after a space the ids it has alone, so the second
    copy is the text's own ids right before the EOS."""
    tok = model.tokenizer
    prompt = (f"Instruct: {instruction.removesuffix(': ')},\nQuery: {text}\nQuery again: {text}" if instruction
              else f"Rewrite the sentence: {text}, rewritten sentence: {text}")
    (ids,) = tok.encode_batch([prompt])
    (alone,) = tok.encode_batch([text])
    assert ids[-len(alone):] == alone
    return [tok.bos_id, *ids, tok.eos_id], 1 + len(ids) - len(alone)


@pytest.mark.parametrize("instruction", ["", INSTRUCTION])
def test_echo_pools_the_causal_states_of_the_second_copy(model, instruction):
    rows = rows_for(model, TEXTS, instruction, 512, "echo")
    for text, (ids, start, end) in zip(TEXTS, rows):
        row, first = by_hand(model, text, instruction)
        assert (ids, start, end) == (row, first, len(row) - 1)
        assert model.tokenizer.decode(ids[start:end]) == text
    got = encode(model, TEXTS, instruction, "mean", layout="echo")  # one padded batch of three lengths
    for i, text in enumerate(TEXTS):
        row, first = by_hand(model, text, instruction)
        with torch.no_grad():  # a plain HF forward: causal, as the model was pretrained
            states = model.lm.model(input_ids=torch.tensor([row])).last_hidden_state[0]
        np.testing.assert_allclose(got[i], states[first:len(row) - 1].mean(0).numpy(), atol=1e-5)
    last = encode(model, TEXTS[:1], instruction, "last", layout="echo")  # the EOS after the second copy
    row, _ = by_hand(model, TEXTS[0], instruction)
    with torch.no_grad():
        eos = model.lm.model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]
    np.testing.assert_allclose(last[0], eos.numpy(), atol=1e-5)


def test_the_second_copy_sees_the_end_of_the_text(model):
    """The point of Echo: the second copy's first token has read the whole text (its last word changes its state),
    which the text's first token read once cannot."""
    texts = ["A man plays a guitar.", "A man plays a violin."]

    def first_token_state(layout: str) -> list[torch.Tensor]:
        found = []
        for ids, start, _ in rows_for(model, texts, "", 512, layout):
            with torch.no_grad():
                found.append(model.lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, start])
        return found

    once, echoed = first_token_state("bos_eos"), first_token_state("echo")
    torch.testing.assert_close(once[0], once[1])
    assert not torch.allclose(echoed[0], echoed[1], atol=1e-4)


def test_each_copy_is_cut_as_the_text_would_be_and_the_row_fits_the_model(model):
    long = " ".join(["word"] * 400)
    (ids, start, end), = rows_for(model, [long], "", 40, "echo")
    assert end - start == 40 - 2  # as bos_eos holds it: max_length less BOS and EOS
    assert ids[start:end] == rows_for(model, [long], "", 40, "bos_eos")[0][0][1:-1]
    (ids, start, end), = rows_for(model, [long], "", 512, "echo")  # two copies of 510 would not fit in 256
    text = rows_for(model, [long], "", 512, "bos_eos")[0][0][1:-1]
    assert model.max_length - 4 <= len(ids) <= model.max_length and ids[start:end] == text[:end - start]
    with pytest.raises(ValueError, match="layout echo: the template takes .* two copies of a text must fit in 256"):
        rows_for(model, ["x"], "word " * 300, 512, "echo")


def test_echo_needs_the_causal_model_and_names_the_layouts(model):
    with pytest.raises(ValueError, match="layout echo reads a causal model.*'bidirectional'"):
        encode(model, TEXTS, layout="echo", attention="bidirectional")
    with pytest.raises(ValueError, match="layout 'twice' is not one of bos_eos, special, text, echo"):
        encode(model, TEXTS, layout="twice")


def test_evaluate_reads_sts_and_clustering_as_echo(hf_dir, model, tmp_path):
    """launch/evaluate.py --set sts.layout=echo: the results record the layout, and STS-B's score is the one of
    encode()'s Echo embeddings (a different score from the default layout's)."""
    from pipeline.eval.data import read_rows
    from pipeline.eval.embeddings import cosine
    from pipeline.eval.metrics import spearman

    out = tmp_path / "results.json"
    assert evaluate_main(["--model", hf_dir, "--tasks", "sts,clustering", "--data-dir", FIXTURES, "--out", str(out),
                          "--set", "sts.layout=echo", "--set", "clustering.layout=echo", "--set",
                          "sts.datasets=[sts/stsb.tsv]", "--no-progress"]) == 0
    results = json.load(open(out))
    assert results["results"]["sts"]["layout"] == results["results"]["clustering"]["layout"] == "echo"
    rows = read_rows(os.path.join(FIXTURES, "sts", "stsb.tsv"), "test")
    a, b = (encode(model, [r.get((c,), c) for r in rows], layout="echo") for c in ("sentence1", "sentence2"))
    expected = 100 * spearman(cosine(a, b), [float(r.get(("score",), "score")) for r in rows])
    assert results["headline"]["sts/stsb"] == pytest.approx(expected, abs=1e-6)
    plain = encode(model, [r.get(("sentence1",), "s") for r in rows])
    assert not np.allclose(plain, a, atol=1e-3)


def test_the_mteb_encoder_reads_a_task_as_echo_with_its_instruction(model):
    """MTEBEncoder(layout="echo"): a query of a retrieval task is embedded under the authors' query template with
    the task's instruction, a document under the paper's template."""
    mteb = pytest.importorskip("mteb")
    from mteb.types import PromptType

    from pipeline.eval.mteb_encoder import MTEBEncoder

    encoder = MTEBEncoder(model, layout="echo", instructions={"SciFact-query": INSTRUCTION})
    task = mteb.get_task("SciFact").metadata
    batches = [{"text": TEXTS[:2]}, {"text": TEXTS[2:]}]
    query = encoder.encode(batches, task_metadata=task, hf_split="test", hf_subset="default",
                           prompt_type=PromptType.query)
    document = encoder.encode(batches, task_metadata=task, hf_split="test", hf_subset="default",
                              prompt_type=PromptType.document)
    np.testing.assert_array_equal(query, encode(model, TEXTS, INSTRUCTION, layout="echo"))
    np.testing.assert_array_equal(document, encode(model, TEXTS, "", layout="echo"))
