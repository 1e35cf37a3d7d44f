# The two commands of the README. Each creates the environment when it is missing and re-installs it when the
# lock changes.
#   make run          the main job (the embedded default policy)
#   make test         lint, type check and the test suite (soaks and scale runs left out: make test-slow)
#   make test-slow    the soaks and scale runs (a 1000-step soak, world-8 layouts)
#   make test-slurm   examples/slurm.sbatch on a real one-node SLURM only (root; part of make test too)
#   make test-py312   the second stack: Python 3.12 with its own lock (megatron-core 0.19), the tests marked
#                     `megatron` (every test of megatron-core's API, the default job); skipped without Python 3.12
# Upgrades, on purpose:
#   make lock         re-resolve requirements/lock.txt from pyproject.toml (newest versions its ranges allow)
#   make lock-py312   the same for requirements/lock-py312.txt, in Python 3.12
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

# The second stack, what most new users install: Python 3.12, where pip resolves the newest megatron-core (0.17 and
# later ship wheels for Python >= 3.12 only) and torch from PyPI, a CUDA build (no CPU build of torch 2.13.0 for 3.12
# lies on these machines' disk; without a GPU it runs on the CPU like the CPU build). Found without a fixed path.
PY312    ?= $(shell sh requirements/find-python.sh 3.12)
VENV312  := .venv-py312
LOCK312  := requirements/lock-py312.txt
NVRX312  := requirements/nvrx-py312.txt
STAMP312 := $(VENV312)/.lifecycle-installed

.PHONY: run bench-diagnose test test-slow test-slurm env lint lock test-latest clean test-py312 env-py312 lock-py312

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

# The tests that start no ranks on both cores (pytest-xdist), then the multi-process ones one at a time.
test: lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -n 2 -m "in_process and not slow" --durations=10
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -m "not in_process and not slow" --durations=40

bench-diagnose: $(STAMP)
	$(VENV)/bin/python bench/diagnose_generated.py 1000000

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -m slow --durations=15

test-slurm: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:randomly -rs tests/slurm --durations=10

# nvidia-resiliency-ext goes to a side folder that only the tests of checkpoint.async_strategy=nvrx put on their path
# (requirements/nvrx-py312.txt says why); the rest of the suite runs as a user without it does (auto -> mcore).
$(STAMP312): $(LOCK312) $(NVRX312) pyproject.toml
	test -n "$(PY312)" || { echo "no Python 3.12 found (python3.12 on PATH, or under pyenv)"; exit 1; }
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install $(PIP) --require-hashes --no-deps -r $(LOCK312)
	$(VENV312)/bin/pip-sync -q --pip-args "--no-deps $(PIP)" $(LOCK312)
	$(VENV312)/bin/python -m pip install $(PIP) --no-deps --no-build-isolation -e .
	$(VENV312)/bin/python -m pip check
	rm -rf $(VENV312)/nvrx
	$(VENV312)/bin/python -m pip install $(PIP) --no-deps --require-hashes --only-binary=:all: --implementation cp \
	  --python-version 3.12 --platform manylinux_2_39_$(shell uname -m) --target $(VENV312)/nvrx -r $(NVRX312)
	touch $@

env-py312: $(STAMP312)

# Skipped, with the reason, where no Python 3.12 is installed.
test-py312:
	@if [ -z "$(PY312)" ]; then echo "make test-py312: skipped: no Python 3.12 here (python3.12 on PATH, or under pyenv)"; \
	else $(MAKE) --no-print-directory $(STAMP312) && \
	  OMP_NUM_THREADS=1 LIFECYCLE_TEST_NVRX=$(CURDIR)/$(VENV312)/nvrx $(VENV312)/bin/pytest -q -p no:randomly \
	    -m "megatron and not slow" --durations=20; fi

# From the public index only: pip's configuration here also offers a local CPU torch for Python 3.11 under the same
# version, whose hash alone would otherwise be locked.
lock-py312: $(STAMP312)
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= CUSTOM_COMPILE_COMMAND="make lock-py312" $(VENV312)/bin/pip-compile -q --upgrade --generate-hashes --no-reuse-hashes --allow-unsafe \
	  --strip-extras --extra dev --no-emit-index-url --no-emit-find-links -o $(LOCK312) pyproject.toml requirements/lock.in

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
	rm -rf $(VENV) $(VENV312) $(LATEST) runs
