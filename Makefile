# Quick start: `make demo` runs the main job on an embedded S3 server; `make test` runs the suite.
# Each target creates its own virtual environment with a CPU build of torch first.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python

.PHONY: venv demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m dcp_fsspec demo

test: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache
