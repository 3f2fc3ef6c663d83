PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all bench coverage cuda clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null

$(VENV)/.installed: $(VENV)/bin/activate setup.cfg pyproject.toml
	$(PY) -m pip install -e '.[test,samples]'
	touch $@

demo: $(VENV)/.installed
	$(PY) samples/char_lm.py

# the fast tier: every feature end to end, in its cheapest cases (tests marked slow left out)
test: $(VENV)/.installed
	$(PY) -m pytest -m "not slow"

# the whole suite; CI runs this (.ci/run)
test-all: $(VENV)/.installed
	$(PY) -m pytest

# the speed comparison; writes benchmarks/results/bench.{json,md,png} (BENCH_ARGS=--quick: a short check run)
bench: $(VENV)/.installed
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

# which layers train (the table of docs/layers.md); fails and prints the new table if docs/layers.md's differs
coverage: $(VENV)/.installed
	$(PY) benchmarks/coverage.py --check docs/layers.md

# the CUDA 11.8 libraries of onnxruntime-training's CUDA provider (a few GB, docs/gpu.md), then the GPU-path checks
cuda: $(VENV)/.installed
	$(PY) -m pip install -e '.[test,samples,cuda]'
	$(PY) -m pytest -rs tests/test_gpu_path.py
	$(PY) benchmarks/gpu_smoke.py

clean:
	rm -rf $(VENV) build *.egg-info
