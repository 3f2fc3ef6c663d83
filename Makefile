PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null

$(VENV)/.installed: $(VENV)/bin/activate setup.cfg pyproject.toml
	$(PY) -m pip install -e '.[test,samples]'
	touch $@

demo: $(VENV)/.installed
	$(PY) samples/char_lm.py

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
