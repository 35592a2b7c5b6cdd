"""The shard contract that data prep writes and training reads: the sample layout, one tar and its index,
the directory's index, shards at a URL, the masking plan and the instruction layout."""
