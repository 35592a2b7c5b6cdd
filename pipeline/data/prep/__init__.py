"""Offline data prep: documents in, shard directories out (``pipeline-build-shards``), the tokenizer
trainer and the shard inspector. Training reaches it only through preflight's build of missing shards."""
