"""Hard-negative mining (``data_prep/mine_negatives.py``): embed a pairs file's queries and corpus with an export,
take each query's nearest documents and keep those that pass sentence-transformers' false-negative filters.
``negatives.py`` is the search and the filters on embeddings; ``cli.py`` reads the pairs, embeds them (this
project's ``encode`` or sentence-transformers) and writes the mined pairs. Above both ``pipeline.eval`` (the
encoder) and ``pipeline.data.prep`` (the pair shards it can build): docs/embedding-recipes.md."""
