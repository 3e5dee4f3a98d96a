# Two entry points on a fresh machine:
#   make run   installs into .venv and runs the main job
#   make test  installs into .venv (with the test extra) and runs lint + the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= .demo-models

.PHONY: install install-test run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned first so pip takes the local CPU wheel on a CPU machine instead of
# resolving an unpinned torch to a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'

run: install
	$(BIN)/raylane demo-models $(DEMO_DIR)
	$(BIN)/raylane generate --model $(DEMO_DIR)/raylane-llama-tiny --chat "Hello from raylane"

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-test lint
	$(BIN)/pytest -q

bench: install
	$(BIN)/raylane bench engine

clean:
	rm -rf $(VENV) $(DEMO_DIR)
