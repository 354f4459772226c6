# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing, install torch==2.13.0 (the local CPU build)
# only when the venv has no torch, then install this project with its test extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.runner-fsm-installed

.PHONY: demo test test-slow venv clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(VENV)/bin/runner-fsm demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs
