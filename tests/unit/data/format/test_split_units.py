"""Sentence/paragraph units (pipeline/data/format/units.py): how a text is cut into them."""

from __future__ import annotations

import pytest

from pipeline.data.format.units import split_units

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
    assert split_units(" A. B.\n\nC ", "record") == ["A. B.\n\nC"] and split_units(" ", "record") == []
    with pytest.raises(ValueError, match="unit mode must be one of sentence, paragraph, record, got 'line'"):
        split_units(DOC, "line")
