"""Fine-tuning tasks of the MLM-vs-CLM protocol: one module per family, the learning-rate x seed protocol shared
(``protocol.py``)."""
