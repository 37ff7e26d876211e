# k3: two commands for newcomers (`make demo`, `make test`); the rest are their parts.
# Every target creates or reuses the git-ignored virtualenv .venv; torch==2.13.0 comes from this
# machine's wheel cache, so nothing large is downloaded.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.k3-installed

.PHONY: demo test lint native browser sandbox-tools census bench clean

$(STAMP): pyproject.toml
	@echo "== setting up $(VENV): k3 and its dev extra (the first time about 3 minutes of pip)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	$(PY) -m pip install --progress-bar on --no-deps nemo-automodel==0.7.0
	touch $(STAMP)
	@echo "== $(VENV) ready: run k3 as $(VENV)/bin/k3, or after 'source $(VENV)/bin/activate' as k3"

# The native CPU kernels (three C++ extensions: MXFP4 matmul and histograms; fused chunked KDA; the fused
# decode step).
# k3 compiles them on first use into ~/.cache/k3/native (pure torch without a compiler); this warms it.
native: $(STAMP)
	$(PY) -m k3.ops.build

# Debian's Chromium for the atlas browser tests. Where it cannot be had the tests skip, saying why; under
# CI=true (where no test may skip) this target fails instead.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  echo "== installing chromium with apt-get (for the atlas browser tests; a minute or two)" && \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null); } || \
	{ if [ "$(CI)" = true ]; then echo "error: CI=true but chromium cannot be installed" >&2; exit 1; \
	  else echo "note: chromium not installed; browser tests will be skipped"; fi; }

# gVisor (runsc) and bubblewrap for the sandbox tests, plus a C compiler for the sandbox's guest helpers.
# Where they cannot be had the sandbox tests skip, saying why; under CI=true this target fails instead.
sandbox-tools:
	@{ command -v runsc && command -v bwrap && command -v cc; } >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  echo "== installing runsc (gVisor), bubblewrap and gcc with apt-get (for the sandbox tests)" && \
	  (apt-get update -qq && apt-get install -y -qq runsc bubblewrap gcc libc6-dev >/dev/null); } || \
	{ if [ "$(CI)" = true ]; then echo "error: CI=true but runsc/bubblewrap cannot be installed" >&2; exit 1; \
	  else echo "note: runsc/bubblewrap not installed; sandbox tests will be skipped"; fi; }

# Two workers, each file in one of them (its module fixtures built once): many tests wait on subprocesses,
# sandboxes and servers rather than compute, so two cores finish the suite in about half the time.
test: $(STAMP) native browser sandbox-tools
	@echo "== running the test suite (about 12 minutes on 2 cores)"
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check k3 tests benchmarks
	$(VENV)/bin/ruff format --check k3 tests benchmarks

# The main job: create the `mini` checkpoint if absent, scan it, serve its atlas and print the URL.
demo: $(STAMP) native
	$(VENV)/bin/k3 atlas demo --dir checkpoints/mini

# Speed and memory against the peers (a few minutes; decode to 64k tokens takes longer: see its --help).
# The training experiments (benchmarks/train_*.py) rewrite benchmarks/results/ and are run by hand.
bench: $(STAMP) native
	for b in kda mxfp4 forward checkpoint_io atlas; do echo "== $$b"; $(PY) benchmarks/$$b.py || exit 1; done
	$(PY) benchmarks/decode.py --contexts 1024,8192 --server

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
