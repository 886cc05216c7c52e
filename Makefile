# make bench: install everything and run the main job; make test: install and run the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch to install into the venv; TORCH= (empty) keeps whatever torch the venv has.
TORCH ?= torch==2.13.0
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu \
	csrc/*/*.cuh csrc/cuda/emu/*)

.PHONY: install test lint bench bench-kernels clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q setuptools wheel ninja numpy scikit-learn pytest pytest-timeout hypothesis ruff tqdm matplotlib
	# the real clients of tests/test_clients.py, installed without changing the torch above
	$(PY) -m pip install -q lightning accelerate $(if $(TORCH),"$(TORCH)")
	touch $@

# --no-build-isolation: compile against the torch in the venv, never a freshly fetched one.
$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

test: install
	$(PY) -m pytest -q
	$(MAKE) lint

lint: $(VENV)/.deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# BENCH_ARGS: more flags, e.g. BENCH_ARGS="--json out.json --plot out.png" (see --help)
bench: install
	$(PY) -m pycomm.bench --link 2.5gbit $(BENCH_ARGS)

bench-kernels: install
	$(PY) benchmarks/bench_fusion.py --json benchmarks/results/fusion.json

clean:
	rm -rf build *.egg-info pycomm/_C*.so $(VENV)/.built
