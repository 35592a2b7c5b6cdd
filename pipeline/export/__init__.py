"""What an export carries besides weights: how the model was trained to be read (``record``), and the
sentence-transformers files that let ``SentenceTransformer(dir)`` embed text as ``pipeline.eval.encode`` does
(``sentence_transformers``). See docs/export.md."""
