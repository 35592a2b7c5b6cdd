"""The ablation report (``launch/report.py``): runs -> recipes and results (``runs``), the papers' tables with their
own numbers (``papers``, ``tables``), and the PNG plots (``plots``)."""
