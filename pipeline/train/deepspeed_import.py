"""DeepSpeed's import without its autotuner's ``import mlflow``. Every ``import deepspeed`` loads
``deepspeed.autotuning.autotuner``, which imports mlflow whenever it is installed (the ``trackers`` extra has it):
that one import was 3 of DeepSpeed's 7 CPU seconds here, paid by every rank and every command at each start
(BENCHMARKS.md, "Start-up"). The pipeline never runs DeepSpeed's autotuner, so that import alone is answered "not
installed" (the autotuner then runs without MLflow); every other ``import mlflow``, the MLflow tracker's among them,
loads it as usual."""

from __future__ import annotations

import importlib.abc
import sys

_AUTOTUNER = "deepspeed.autotuning.autotuner"
_IMPORT_MACHINERY = ("importlib._bootstrap", "importlib._bootstrap_external", __name__)


class _AutotunerWithoutMlflow(importlib.abc.MetaPathFinder):
    """Refuses ``mlflow`` to the autotuner module's own import statement; finds nothing else."""

    def find_spec(self, name, path=None, target=None):
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") in _IMPORT_MACHINERY:
            frame = frame.f_back
        if frame is not None and frame.f_globals.get("__name__") == _AUTOTUNER:
            raise ModuleNotFoundError(f"mlflow is not imported for {_AUTOTUNER}", name=name)
        return None


def skip_autotuner_mlflow() -> None:
    """Install the finder first on ``sys.meta_path`` (once): call before DeepSpeed is first imported."""
    if not any(isinstance(f, _AutotunerWithoutMlflow) for f in sys.meta_path):
        sys.meta_path.insert(0, _AutotunerWithoutMlflow())
