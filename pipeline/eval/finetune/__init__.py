"""Fine-tuning tasks of the MLM-vs-CLM protocol: one module per family, the sweep shared (``sweep.py``)."""
