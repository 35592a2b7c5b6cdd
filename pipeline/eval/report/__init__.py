"""The ablation report (``launch/report.py``): runs -> variants and results (``runs``), the papers' tables with their
own numbers (``papers``, ``tables``), and the PNG plots (``plots``)."""
