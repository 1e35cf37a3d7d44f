# The two commands of the README. Each creates the environment when it is missing and re-installs it when the
# lock changes.
#   make run          the main job (the embedded default policy)
#   make test         lint, type check and the test suite (soaks and scale runs left out: make test-slow)
#   make test-slow    the soaks and scale runs (a 1000-step soak, world-8 layouts)
#   make test-slurm   examples/slurm.sbatch on a real one-node SLURM only (root; part of make test too)
# Upgrades, on purpose:
#   make lock         re-resolve requirements/lock.txt from pyproject.toml (newest versions its ranges allow)
#   make test-latest  the same checks in a separate .venv-latest with the newest versions, not the lock
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lifecycle-installed
PYTHON ?= python3
LOCK   := requirements/lock.txt
LATEST := .venv-latest
# torch stays at the CPU build on these machines' disk: an unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
PIP    := -q --disable-pip-version-check

.PHONY: run test test-slow test-slurm env lint lock test-latest clean

env: $(STAMP)

# Exactly the locked set: every package pinned and hash-checked (--no-deps: nothing outside the lock is
# resolved), then pip-sync (from the lock) removes whatever the lock does not name, then the project itself.
$(STAMP): $(LOCK) pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP) --require-hashes --no-deps -r $(LOCK)
	$(VENV)/bin/pip-sync -q --pip-args "--no-deps $(PIP)" $(LOCK)
	$(PY) -m pip install $(PIP) --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

run: $(STAMP)
	$(VENV)/bin/lifecycle run

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy lifecycle

test: lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -m "not slow" --durations=40

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -m slow --durations=15

test-slurm: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -rs tests/slurm --durations=10

lock: $(STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile -q --upgrade --generate-hashes --allow-unsafe --strip-extras --extra dev \
	  --no-emit-index-url --no-emit-find-links \
	  -o $(LOCK) pyproject.toml requirements/lock.in

# What the newest releases would break, found by whoever upgrades: pyproject's ranges, newest versions.
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install $(PIP) --upgrade pip
	$(LATEST)/bin/pip install $(PIP) $(TORCH)
	$(LATEST)/bin/pip install $(PIP) --upgrade --upgrade-strategy eager -e '.[dev]' $(TORCH)
	$(LATEST)/bin/pip list --format=freeze --exclude-editable > $(LATEST)/versions.txt
	$(LATEST)/bin/python -m tests.lockfile $(LOCK) $(LATEST)/versions.txt
	$(LATEST)/bin/ruff check
	$(LATEST)/bin/mypy lifecycle
	OMP_NUM_THREADS=1 $(LATEST)/bin/pytest -q -p no:randomly -m "not slow" --durations=40

clean:
	rm -rf $(VENV) $(LATEST) runs
