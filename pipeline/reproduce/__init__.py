"""`make reproduce`: the three papers' findings at CPU scale on real data (docs/results.md)."""
