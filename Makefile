# The two commands of the README. Each creates the environment when it is missing.
#   make run    the main job (the embedded default policy)
#   make test   lint, type check and the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lifecycle-installed
PYTHON ?= python3

.PHONY: run test env lint clean

env: $(STAMP)

# torch==2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip uninstall -q -y lifecycle 2>/dev/null || true  # the distribution's old name
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/lifecycle run

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy lifecycle

test: lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly --durations=15

clean:
	rm -rf $(VENV) runs
