"""The cluster planner (``launch/plan.py``, ``pipeline-plan``): what a run needs before asking for a cluster.

``estimates``: memory per GPU, step time, GPU-hours and data prep from the model and cluster shape;
``report``: the planner's input, its verdicts as a printed report, and the command line.
"""
