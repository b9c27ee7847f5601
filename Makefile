# Two commands do all the set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moe_replay-installed
DEMO_OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: install demo test test-fast docs bench clean

# bootstrap.py is idempotent and keyed by a hash of its inputs: a no-op when up to date.
install:
	@$(PYTHON) scripts/bootstrap.py --venv $(VENV)

demo: install
	$(PY) -m moe_replay.cli demo --out $(DEMO_OUT)

# Every test (what CI runs: ~69 min on a 2-core CPU, docs/benchmarks.md). test-fast: the tier without engines and
# multi-process runs (no vLLM engine, nothing marked slow), for a quick check while editing.
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not vllm and not slow" $(PYTEST_ARGS)

# The API reference from the docstrings, one page per module (mkdocs.yml, scripts/mkdocs_api.py);
# --strict: a broken reference or link fails the build (tests/test_api_docs.py runs the same in CI).
docs: install
	$(PY) -m mkdocs build --strict
	@echo "API reference: build/site/api/index.html"

bench: install
	$(PY) -m moe_replay.cli bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs build/site build/docs_src
