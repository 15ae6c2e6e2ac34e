# Quick start: `make demo` runs the main job on an embedded S3 server; `make test` runs the suite.
# Each target sets up the virtual environment it needs: .venv (a CPU build of torch first, then
# the test extra) for the suite and the benchmarks; .venv-demo (torch and the demo extra) for the
# demo, unless a venv already holds what it needs; .venv-docs (the docs extra, no torch).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python

.PHONY: venv demo lint test bench mutation clean

# torchtitan for its integration's tests, without its dependencies: its full requirements
# (datasets<4.8) would hold fsspec and s3fs back to 2026.2.0 for the whole suite. These are what
# importing its checkpoint manager and optimizers needs (the [torchtitan] extra is the full
# install, for users).
TITAN  ?= torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(TITAN)
	touch $@

venv: $(VENV)/.installed

# The demo's own light venv: a CPU torch, then this checkout with the demo extra only.
.venv-demo/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-demo
	.venv-demo/bin/python -m pip install -q "$(TORCH)"
	.venv-demo/bin/python -m pip install -q -e ".[demo]"
	touch $@

# The demo runs in the first venv that can already import it and moto's server: the active one
# ($VIRTUAL_ENV), then .venv. Only where neither can is .venv-demo made. DEMO_ARGS go to the
# demo, e.g. DEMO_ARGS='--url runs/demo' keeps its checkpoints.
DEMO_READY := import dcp_fsspec.demo, moto.server
DEMO_ARGS ?=
demo:
	@for py in $${VIRTUAL_ENV:+"$$VIRTUAL_ENV/bin/python"} "$(PY)"; do \
		if [ -x "$$py" ] && "$$py" -c "$(DEMO_READY)" 2>/dev/null; then \
			echo "make demo: in $$py"; exec "$$py" -m dcp_fsspec demo $(DEMO_ARGS); \
		fi; \
	done; \
	$(MAKE) -q .venv-demo/.installed || { \
		echo "make demo: no venv here runs the demo; making .venv-demo (a CPU torch and the demo extra)"; \
		$(MAKE) --no-print-directory .venv-demo/.installed; \
	} && exec .venv-demo/bin/python -m dcp_fsspec demo $(DEMO_ARGS)

# One formatter and the lint rules for the whole tree ([tool.ruff] in pyproject.toml).
# `ruff format .` lays the lines out; `ruff check --fix .` sorts the imports.
lint: venv
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# The lint, then the suite, under ten minutes on two cores. The slow multi-rank cases (marker
# `slow`) run too under SLOW=1, which .ci/run sets: `make test SLOW=1` runs everything.
SLOW ?=
test: lint
	$(PY) -m pytest -q $(if $(filter 1 true yes,$(SLOW)),,-m "not slow")

# One process, then two gloo ranks (memory:// lives in one process: not at 2 ranks); each run
# writes its tables under benchmarks/results/. `python -m benchmarks.run --help` for the rest
# (--server ceph|seaweedfs, --sizes 256M,1G,4G).
bench: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.run --ranks 2 --backends s3,local --no-async --out benchmarks/results/ranks2

# Mutation testing of the commit protocol, the pointer, the step layout and retention (config:
# [tool.mutmut] in pyproject.toml; equivalent mutants: mutation/EQUIVALENT.md). Not part of
# `make test`: it runs in a copy of the tree under build/mutation, for an hour or more on two
# cores. MUTANTS='dcp_fsspec.checkpoint.layout.*' narrows it to some mutants.
MUTANTS ?=
$(VENV)/.mutation: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,mutation]"
	touch $@

mutation: $(VENV)/.mutation
	rm -rf build/mutation && mkdir -p build/mutation
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C build/mutation
	cd build/mutation && $(abspath $(VENV))/bin/mutmut run --max-children 2 $(MUTANTS)
	cd build/mutation && $(abspath $(PY)) ../../mutation/score.py

clean:
	rm -rf $(VENV) .venv-demo .venv-docs .pytest_cache

# The documentation site (docs/, mkdocs.yml) into site/, in a venv of its own with the pinned
# `docs` extra and none of the package's dependencies: mkdocstrings reads the sources as text, and
# the charts need only matplotlib, so torch is not installed. --strict: a broken link or a
# docstring reference that does not resolve fails. The charts it shows are committed;
# `python -m benchmarks.plot --check` fails when they no longer match
# benchmarks/results/latest.json.
.venv-docs/.installed: pyproject.toml .ci/extra_requirements.py
	$(PYTHON) -m venv .venv-docs
	.venv-docs/bin/python -m pip install -q 'tomli>=1.1; python_version < "3.11"'
	.venv-docs/bin/python .ci/extra_requirements.py docs > .venv-docs/requirements.txt
	.venv-docs/bin/python -m pip install -q -r .venv-docs/requirements.txt
	touch $@

.PHONY: docs
docs: .venv-docs/.installed
	.venv-docs/bin/python -m benchmarks.plot --check
	.venv-docs/bin/python -m mkdocs build --strict
