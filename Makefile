# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install, run the embedded default sweep, print the table
#   make test   - create .venv, install, run the test suite
PYTHON ?= python3
# The CPU build of torch; this machine image carries its wheel locally. Override, e.g. TORCH="torch==2.13.0+cu128".
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test ui clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedsweep sweep sweeps/default.yaml

# pytest exits 5 when it collects no test; that is a failure here, as is any other non-zero code.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

ui: $(STAMP)
	$(BIN)/fedsweep ui

clean:
	rm -rf $(VENV) mlflow.db mlartifacts ray_results .pytest_cache
