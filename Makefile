# hplan: `make demo` and `make test` work on a fresh machine (they set up .venv/ first).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
HPLAN := $(VENV)/bin/hplan
# Installed only when the environment has no torch; bring your own torch to skip it.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo

.PHONY: setup demo test lint typecheck unit bench clean net-tools

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,hf]"
	@touch $@

demo: setup
	$(HPLAN) solve examples/gpt/model.py --cluster examples/clusters/mixed-3090-4090.yaml -b 2048 -o $(DEMO_OUT)
	$(HPLAN) show $(DEMO_OUT)/plan.json
	$(HPLAN) rehearse $(DEMO_OUT)/plan.json --steps 8

lint: setup
	$(VENV)/bin/ruff check planner runtime templates tests bench examples
	$(VENV)/bin/ruff format --check planner runtime templates tests bench examples
	$(VENV)/bin/lint-imports --no-cache  # the layering contracts in pyproject.toml

typecheck: setup
	$(VENV)/bin/mypy  # the packages in pyproject.toml, through the hplan/ links

# The shaped-link test (tests/runtime/test_bandwidth.py) needs `ip` and `tc` (Debian's iproute2)
# and root. As root with apt-get, a missing iproute2 is installed; otherwise (not root, no
# apt-get, no network) the test skips and says why. Never fails `make`.
net-tools:
	@{ command -v ip && command -v tc; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { apt-get install -y -q iproute2 >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; }; }; } || \
	  echo "note: iproute2 (ip, tc) is not installed; the shaped-link bandwidth test will be skipped"

# Two workers (pytest-xdist): CI has 2 cores and most tests wait on their ranks' processes;
# loadgroup keeps a module marked xdist_group on one worker (its module fixture built once).
# Tests whose outcome hangs on which rank ends first (marker `serial`) run alone afterwards.
unit: setup net-tools
	$(VENV)/bin/pytest -n 2 --dist loadgroup -m "not serial"
	$(VENV)/bin/pytest -m serial

test: lint typecheck unit

bench: setup
	$(PY) bench/solver.py
	$(PY) bench/plan_quality.py
	$(PY) bench/plan_quality.py --compare sync
	$(PY) bench/rehearsal.py

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache
