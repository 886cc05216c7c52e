# make bench: install everything and run the main job; make test: install and run the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch to install into the venv; TORCH= (empty) keeps whatever torch the venv has.
TORCH ?= torch==2.13.0
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu \
	csrc/*/*.cuh csrc/cuda/emu/*)

.PHONY: install test lint bench bench-kernels report clean deps-frameworks frameworks

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q setuptools wheel ninja numpy scikit-learn pytest pytest-timeout hypothesis ruff import-linter tqdm matplotlib
	# the real clients of tests/integrations/test_clients.py, installed without changing the
	# torch above
	$(PY) -m pip install -q lightning accelerate $(if $(TORCH),"$(TORCH)")
	# the [ft] extra (torchft, for manager=: tests/ft), without changing the torch above
	$(PY) -m pip install -q "torchft==0.2.0" $(if $(TORCH),"$(TORCH)")
	touch $@

# the Hugging Face Trainer and Ray Train, for tests/integrations/test_transformers.py and
# tests/integrations/test_ray.py
# (scripts/frameworks_check.sh), installed without changing the torch above
$(VENV)/.deps-frameworks: $(VENV)/.deps
	$(PY) -m pip install -q transformers "ray[train]" $(if $(TORCH),"$(TORCH)")
	touch $@

# --no-build-isolation: compile against the torch in the venv, never a freshly fetched one.
$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

# the frameworks tests and the slow runs (whole benchmarks, torchrun, faults) are left out
# (over make test's time): make frameworks runs them
test: install
	$(PY) -m pytest -q -m "not frameworks and not slow"
	$(MAKE) lint

deps-frameworks: $(VENV)/.deps-frameworks

# offline: no hub downloads, no usage reports; Ray on the loopback only (tests/scripts/train_ray.py)
frameworks: install $(VENV)/.deps-frameworks
	$(PY) -c "import transformers, ray.train.torch"
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q \
		-m frameworks tests/integrations/test_transformers.py tests/integrations/test_ray.py \
		tests/integrations/test_optional_clients.py tests/repo/test_docs.py
	$(PY) -m pytest -q -m slow

# the package's layers and no import circle: the contracts in pyproject.toml (import-linter)
lint: $(VENV)/.deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

# BENCH_ARGS: more flags, e.g. BENCH_ARGS="--json out.json --plot out.png" (see --help)
bench: install
	$(PY) -m pycomm.bench --link 2.5gbit $(BENCH_ARGS)

# the docs' tables of measured figures, from benchmarks/results/*.json (tests/repo/test_report.py
# fails when a table and its JSON disagree)
report: install
	$(PY) -m pycomm.bench.tables

bench-kernels: install
	$(PY) benchmarks/bench_fusion.py --json benchmarks/results/fusion.json

clean:
	rm -rf build *.egg-info pycomm/_C*.so $(VENV)/.built
