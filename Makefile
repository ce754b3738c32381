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

.PHONY: setup demo test test-fast lint ui clean test-services

# torch with pip, which reads pip's configuration: where torch's local CPU build lies (find-links). The other 148
# pinned packages with uv, a pip-compatible installer that downloads and unpacks in parallel: 12-14 s against pip's
# 59-63 s, cold caches, the same packages (docs/performance.md, "Seventy-third session"). uv reads no pip
# configuration: it gets the index-url pip would use (PIP_INDEX_URL, then pip.conf's [install], then [global]: a
# mirror), and pip installs them instead where pip's configuration says no-index, where pip cannot fetch uv, or where
# uv fails (an index it cannot reach, a custom CA).
# pip byte-compiles what it installs file by file in its one process; compileall does the same files on every core
# afterwards (89 s with pip's compiling, 74 s so; "Seventieth session"). The .pyc files matter: under
# PYTHONDONTWRITEBYTECODE no process writes them, and each would compile torch's modules itself.
# compileall exits 1 on a file no Python 3.11 compiles (torch's Python 3.12 test helper), which pip skips too.
# Not the packages' own test folders (tests/ or test/ inside site-packages: 3,490 of 19,977 files, pandas' 1,143 the
# most), which no fedsweep process imports: compileall 20.1-21.4 s against 31.3 s (the same files, forced, twice
# each), `make setup` from fresh clones 52.1 / 54.5 s against 58.1 / 64.5 s, alone (docs/performance.md,
# "Seventy-fifth session").
UV := uv==0.13.10
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	conf=$$($(BIN)/python -m pip config list 2>/dev/null); \
	index=$$(printf '%s\n' "$$conf" | sed -n "s/^\([^=]*\)[.]index-url='\(.*\)'$$/\1 \2/p" | \
	  awk '{r = $$1 == ":env:" ? 0 : $$1 == "install" ? 1 : 2} !n || r < best {best = r; v = $$2; n = 1} END {print v}'); \
	{ ! printf '%s\n' "$$conf" | grep -q '[.]no-index=' && $(BIN)/python -m pip install -q "$(UV)" && \
	  $(BIN)/uv pip install -q --python $(BIN)/python $${index:+--index-url "$$index"} -c constraints.txt -e ".[test]"; } || \
	  $(BIN)/python -m pip install -q --no-compile -c constraints.txt -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 -x '/site-packages/[^/]+/(.+/)?tests?/' $(VENV)/lib >/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# PyTorch's AVX2 kernels and MKL's branch for every x86-64 CPU (COMPATIBLE), unless ATEN_CPU_CAPABILITY / MKL_CBWR
# are set: each CPU's own kernels round two rows' sums otherwise, MKL's by the CPU's maker and model (README, "The two
# commands")
demo: $(STAMP)
	ATEN_CPU_CAPABILITY=$${ATEN_CPU_CAPABILITY:-avx2} MKL_CBWR=$${MKL_CBWR:-COMPATIBLE} $(BIN)/fedsweep sweep sweeps/default.yaml

# Debian packages the tests start for real: chromium + chromium-driver (the MLflow UI test, headless)
# and the PostgreSQL server (the MLflow store test). Installed here when missing and this runs as
# root; otherwise the tests that need them fail saying what to install.
test-services:
	@{ command -v chromium && command -v chromedriver && ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver postgresql >/dev/null; } || true

# ruff with the rules of pyproject.toml's [tool.ruff]; `make test` (and so .ci/run) runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .

# pytest exits 5 when it collects no test; that is a failure here, as is any other non-zero code.
# Three pytest workers, a test file each at a time (--dist loadfile: a module's shared sweep or server runs once):
# on 2 cores, 831 s against 928 s with two, the same hour; 746.6 s at 3e71fda (docs/performance.md, targets). PYTEST_ARGS="-n 0" runs one.
# Files go out in the order tests/conftest.py sorts them (heaviest first), not xdist's (most tests first).
XDIST := -n 3 --dist loadfile --no-loadscope-reorder
test: $(STAMP) lint test-services
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The inner loop: no Ray, no slow test, no real data (a test that starts Ray unmarked fails, tests/conftest.py).
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not ray and not slow and not real_data" $(PYTEST_ARGS)

ui: $(STAMP)
	$(BIN)/fedsweep ui

clean:
	rm -rf $(VENV) mlflow.db mlartifacts ray_results .pytest_cache
