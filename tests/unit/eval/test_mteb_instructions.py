"""MTEBEncoder's task instructions, LLM2Vec's protocol (experiments/mteb_eval_custom.py): run by mteb.evaluate on
local tasks (real mteb task classes whose data is defined here; nothing downloaded), each text's embedding compared
with encode() of the text under the instruction it should get."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from pipeline.eval import encode, load_model
from pipeline.experiment import SAMPLE_DIR
from pipeline.tokenizer import load_tokenizer

mteb = pytest.importorskip("mteb")
from datasets import Dataset  # noqa: E402
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData  # noqa: E402
from mteb.mocks.mock_tasks.retrieval import MockRetrievalTask  # noqa: E402

from pipeline.eval.mteb_encoder import LLM2VEC_INSTRUCTIONS, MTEBEncoder  # noqa: E402

QUERIES = ["Aspirin lowers the risk of heart attacks.", "Vitamin C cures the common cold."]
DOCUMENTS = ["A trial of daily aspirin in older adults found fewer cardiac events.",
             "Vitamin C supplements did not shorten colds in most trials.", "The river floods every spring."]
PAIRS = {"sentence1": ["A man plays a guitar.", "A dog runs in a field.", "Two kids read a book."],
         "sentence2": ["Someone plays an instrument.", "A cat sleeps on a sofa.", "Children are reading."],
         "score": [0.9, 0.1, 0.8]}
SCIFACT = "Given a scientific claim, retrieve documents that support or refute the claim"  # llm2vec's, without ':'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from helpers import tiny_llama

    tok = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    out = str(tmp_path_factory.mktemp("model") / "tiny")
    tiny_llama(tok).save_pretrained(out)
    tok.save(out)
    return load_model(out)


def local(name: str):
    """mteb's own task class ``name`` holding the data above instead of its hub dataset."""
    cls = type(mteb.get_task(name))

    class Local(cls):
        def load_data(self, **kwargs):
            if self.metadata.type == "Retrieval":
                split = RetrievalSplitData(
                    queries=Dataset.from_list([{"id": f"q{i}", "text": t} for i, t in enumerate(QUERIES)]),
                    corpus=Dataset.from_list([{"id": f"d{i}", "text": t} for i, t in enumerate(DOCUMENTS)]),
                    relevant_docs={"q0": {"d0": 1}, "q1": {"d1": 1}}, top_ranked=None)
                self.dataset = {"default": {"test": split}}
            else:
                self.dataset = {"test": Dataset.from_dict(PAIRS)}
            self.data_loaded = True

    return Local()


class Spy(MTEBEncoder):
    """Records (prompt type, texts, embeddings) of each call MTEB makes."""

    def encode(self, inputs, **kwargs):
        batches = list(inputs)
        out = super().encode(batches, **kwargs)
        self.calls.append((kwargs.get("prompt_type"), [t for b in batches for t in b["text"]], out))
        return out


def run(model, task, **kwargs) -> list:
    spy = Spy(model, **kwargs)
    spy.calls = []
    mteb.evaluate(spy, task, cache=None, show_progress_bar=False)
    return spy.calls


def check(model, calls, expected: dict):
    """Every call's embeddings are encode()'s under the instruction ``expected`` gives its prompt type."""
    assert {str(p) for p, _, _ in calls} == {str(p) for p in expected}
    for prompt_type, texts, out in calls:
        np.testing.assert_allclose(out, encode(model, texts, expected[prompt_type]), atol=1e-5)


def test_retrieval_instructs_the_queries_with_llm2vecs_instruction_and_not_the_documents(model):
    from mteb.types import PromptType

    assert json.load(open(LLM2VEC_INSTRUCTIONS))["SciFact"] == SCIFACT + ":"
    calls = run(model, local("SciFact"))
    check(model, calls, {PromptType.query: SCIFACT + ": ", PromptType.document: ""})
    (queries,) = (out for p, _, out in calls if p == PromptType.query)
    assert np.abs(queries - encode(model, QUERIES, "")).max() > 1e-4  # the instruction conditions them


def test_symmetric_task_instructs_both_sides(model):
    calls = run(model, local("STSBenchmark"))  # llm2vec: "Retrieve semantically similar text:"
    check(model, calls, {None: "Retrieve semantically similar text: "})
    assert sorted(t for _, texts, _ in calls for t in texts) == sorted(PAIRS["sentence1"] + PAIRS["sentence2"])


def test_a_task_absent_from_the_table_gets_mtebs_own_instruction(model):
    from mteb.types import PromptType

    task = MockRetrievalTask()  # not in llm2vec's table: MTEB's "Retrieve text based on user query."
    task.metadata = task.metadata.model_copy(update={"eval_splits": ["test"]})
    check(model, run(model, task), {PromptType.query: "Retrieve text based on user query: ", PromptType.document: ""})


def test_a_custom_table_overrides_and_the_models_format_joins_it(model, tmp_path):
    from mteb.types import PromptType

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"SciFact": "Find the evidence for this claim:"}))
    check(model, run(model, local("SciFact"), task_instructions=str(path)),
          {PromptType.query: "Find the evidence for this claim: ", PromptType.document: ""})
    check(model, run(model, local("SciFact"), task_instructions=None), {PromptType.query: "", PromptType.document: ""})
    # a supervised export takes bare instructions and joins them with its recorded format
    formatted = dataclasses.replace(model, record=dataclasses.replace(model.record, instruction_format="{instruction}; "))
    meta = mteb.get_task("SciFact").metadata
    got = MTEBEncoder(formatted, task_instructions=str(path)).encode(
        [{"text": QUERIES}], task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=PromptType.query)
    np.testing.assert_allclose(got, encode(model, QUERIES, "Find the evidence for this claim; "), atol=1e-5)


@pytest.mark.parametrize("content, says", [
    ("{not json", "cannot read it as JSON"), ('["SciFact"]', "expected a JSON object"),
    ('{"SciFact": 3}', '{"SciFact": 3}'), ('{"SciFact": " "}', "non-empty strings"), (None, "No such file")])
def test_a_bad_table_is_one_line_naming_the_file(model, tmp_path, content, says):
    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="task_instructions") as e:
        MTEBEncoder(model, task_instructions=str(path))
    assert str(path) in str(e.value) and says in str(e.value) and "\n" not in str(e.value)
