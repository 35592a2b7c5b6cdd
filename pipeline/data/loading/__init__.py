"""What training reads shards with: the loader, the deterministic orders, the source mixture, the
held-out split and the batch."""
