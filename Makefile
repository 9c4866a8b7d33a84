# Two entry points, both safe on a fresh machine: each creates .venv on first use.
#   make serve [MODEL=path/to/hf/folder]   set up, then serve the model (default: the bundled demo model)
#   make test                              set up, then run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=
SERVE_ARGS ?=

.PHONY: setup serve test test-heavy lint format soak chaos-soak clean

setup: $(STAMP)

# torch is installed first and pinned: on a CPU machine 2.13.0 is a local wheel, while an
# unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/mmserve serve $(MODEL) $(SERVE_ARGS)

# The heavy tests (multi-process tensor parallel and Ray, torch.compile, the event-loop
# watchdog, gpu_check's CPU run) take minutes each: `make test-heavy` runs them.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not heavy" tests

test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

soak: $(STAMP)
	$(BIN)/python tests/reliability/soak.py --out soak-results.json --log soak-server.log

# Issue 20's chaos soak: CHAOS_MINUTES of traffic at concurrency 32, a preprocess worker killed every 20 s.
CHAOS_MINUTES ?= 10
chaos-soak: $(STAMP)
	$(BIN)/python tests/reliability/chaos_soak.py --minutes $(CHAOS_MINUTES) --concurrency 32 --kill-every 20 \
		--out chaos-results.json --log chaos-server.log

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
