"""Sentence/paragraph units: splitting, the unit sample layout, the optional paraphrase member through shards,
Sample.validate and collate, and build_shards' unit mode on the sample corpus."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.batch import collate
from pipeline.data.build_sample import PlanSettings, make_sample
from pipeline.data.format import Sample
from pipeline.data.shards import ShardReader, ShardWriter
from pipeline.data.units import split_units, unit_sample

DOC = """SCENE II. A Camp near Forres.

[Alarum within.]
  \t
DUNCAN.
What bloody man is that? He can report,
As seemeth by his plight, of the revolt
The newest state.

MALCOLM.
"Hail, brave friend!" Say to the king the knowledge (of the broil.) As thou didst leave it"""


def test_paragraphs_are_blocks_between_blank_lines():
    assert split_units(DOC, "paragraph") == [
        "SCENE II. A Camp near Forres.",
        "[Alarum within.]",
        "DUNCAN.\nWhat bloody man is that? He can report,\nAs seemeth by his plight, of the revolt\nThe newest state.",
        'MALCOLM.\n"Hail, brave friend!" Say to the king the knowledge (of the broil.) As thou didst leave it',
    ]


def test_sentences_end_at_punctuation_and_flatten_line_breaks():
    assert split_units(DOC, "sentence") == [
        "SCENE II.", "A Camp near Forres.", "[Alarum within.]", "DUNCAN.", "What bloody man is that?",
        "He can report, As seemeth by his plight, of the revolt The newest state.", "MALCOLM.",
        '"Hail, brave friend!"', "Say to the king the knowledge (of the broil.)", "As thou didst leave it"]
    assert split_units("  \n\n ", "sentence") == [] and split_units("no end", "sentence") == ["no end"]
    with pytest.raises(ValueError, match="unit mode must be one of sentence, paragraph, got 'line'"):
        split_units(DOC, "line")


def test_unit_sample_wraps_pads_and_truncates():
    ids, n, cut = unit_sample([10, 11, 12], 8, pad_id=0, bos_id=1, eos_id=2)
    assert ids.tolist() == [1, 10, 11, 12, 2, 0, 0, 0] and n == 5 and not cut and ids.dtype == np.int32
    ids, n, cut = unit_sample(list(range(10, 20)), 6, pad_id=0, bos_id=1, eos_id=2)
    assert ids.tolist() == [1, 10, 11, 12, 13, 2] and n == 6 and cut
    ids, n, cut = unit_sample([10, 11], 4, pad_id=0, bos_id=None, eos_id=None)
    assert ids.tolist() == [10, 11, 0, 0] and n == 2 and not cut
    with pytest.raises(ValueError, match="no room for text between BOS and EOS; raise --max-unit-tokens"):
        unit_sample([10], 2, pad_id=0, bos_id=1, eos_id=2)


def _unit(key_index: int, ids: list[int], paraphrase: list[int] | None, seq_len: int = 8) -> Sample:
    input_ids, n, _ = unit_sample(ids, seq_len, 0, 1, 2)
    para = None if paraphrase is None else unit_sample(paraphrase, seq_len, 0, 1, 2)[0]
    plan = PlanSettings(seed=0, special_ids=np.array([0, 1, 2]), span_fraction=0.0)
    return make_sample(input_ids, np.array([[0, n]], np.int32), 0, key_index, plan, paraphrase=para)


def test_paraphrase_member_round_trips_through_a_shard(tmp_path):
    samples = [_unit(0, [10, 11, 12], [20, 21]), _unit(1, [13], [22, 23, 24, 25])]
    assert samples[0].spans.shape == (0, 2)  # units have no MAGNET spans
    writer = ShardWriter(str(tmp_path / "s.tar"))
    for s in samples:
        writer.write(s)
    writer.close()
    back = list(ShardReader(str(tmp_path / "s.tar")))
    for s, b in zip(samples, back):
        b.validate(8)
        assert b.paraphrase.dtype == np.int32 and np.array_equal(b.paraphrase, s.paraphrase)
    batch = collate(back)
    assert batch.paraphrase_ids.tolist() == [[1, 20, 21, 2, 0, 0, 0, 0], [1, 22, 23, 24, 25, 2, 0, 0]]
    assert batch.to("cpu").paraphrase_ids.dtype == batch.paraphrase_ids.dtype
    without = _unit(2, [10], None)
    assert collate([without]).paraphrase_ids is None and collate([without]).to("cpu").paraphrase_ids is None


def test_paraphrase_errors_name_the_sample():
    good = _unit(0, [10, 11], [20])
    with pytest.raises(ValueError, match=r"sample f000000s00000000: paraphrase has shape \(7,\), expected \(8,\)"):
        Sample(**{**good.__dict__, "paraphrase": good.paraphrase[:7]}).validate(8)
    with pytest.raises(ValueError, match="paraphrase has dtype int64, expected int32"):
        Sample(**{**good.__dict__, "paraphrase": good.paraphrase.astype(np.int64)}).validate(8)
    with pytest.raises(ValueError, match=r"samples \['f000000s00000001'\] have no paraphrase while others"):
        collate([good, _unit(1, [10], None)])
    filler = Sample("", np.zeros(8, np.int32), np.zeros((0, 2), np.int32), good.mask_rank, good.mask_draw,
                    np.zeros((0, 2), np.int32))
    assert collate([good, filler]).paraphrase_ids[1].tolist() == [0] * 8  # a padding row pads its paraphrase
