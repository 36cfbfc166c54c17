# Quick start: `make demo` compiles the bundled PPO example and prints its plan; `make test` runs
# the tests. Each creates .venv when missing (torch 2.13.0 first unless torch is importable, so
# pip never pulls a multi-GB CUDA build on a CPU machine) and installs the project editable.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-heavy test-solver check test-engines bench bench-smoke timelines venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planner compile examples/ppo_llama7b.py -o plans/ppo_llama7b.json
	$(VENV)/bin/planner validate plans/ppo_llama7b.json

test: $(STAMP)
	$(PY) -m pytest -q -m "not bench and not solver and not heavy"

# The longest four-rank runs against their single-process references (30-70 s each, about six
# minutes together): CI runs them after make test, which stays under 15 minutes.
test-heavy: $(STAMP)
	$(PY) -m pytest -q -m heavy

# Checks of the CP-SAT models against the solver without presolve on full-size instances (tens of
# seconds each; CI runs them after make test, which stays under 15 minutes).
test-solver: $(STAMP)
	$(PY) -m pytest -q -m solver

# Every benchmark script run to its end in a tiny mode (tests/test_bench_smoke.py; CI runs it
# after make test): a broken benchmark is a red check, and make test stays under 15 minutes.
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -m bench

# Static checks (configured in pyproject.toml): ruff (pyflakes, import order, bugbear) and mypy
# with the pydantic plugin over plans/ cost_models/ planner/ runtime/.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Exports checked by the engines themselves (DeepSpeed 0.19.8, verl 0.9.1, OpenRLHF 0.11.2,
# megatron-core 0.16.1) in their own environment, .venv-engines (no GPU builds: DS_BUILD_OPS=0,
# engines without their dependency trees, then what their parsers import). Set MEGATRON_LM_SRC
# to a Megatron-LM tree at core_v0.19.0 to run its parse_args/validate_args too (needs triton).
ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed
ENGINE_MATRIX := out/engines

$(ENGINES_STAMP): tests/engines/requirements.txt tests/engines/requirements-parsers.txt
	@test -x $(ENGINES)/bin/python || $(PYTHON) -m venv $(ENGINES)
	@$(ENGINES)/bin/python -c "import torch" 2>/dev/null || $(ENGINES)/bin/python -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(ENGINES)/bin/python -m pip install -q --no-deps -r tests/engines/requirements.txt
	$(ENGINES)/bin/python -m pip install -q -r tests/engines/requirements-parsers.txt
	@touch $(ENGINES_STAMP)

test-engines: $(STAMP) $(ENGINES_STAMP)
	$(PY) -m tests.engines.matrix $(ENGINE_MATRIX)
	ENGINE_MATRIX=$(ENGINE_MATRIX) PLANNER=$(CURDIR)/$(VENV)/bin/planner $(ENGINES)/bin/python -m pytest -q -c tests/engines/pytest.ini \
		--rootdir tests/engines tests/engines

EXAMPLES := tiny_ppo ppo_llama7b grpo_qwen7b sft_llama3_70b

timelines: $(STAMP)
	@mkdir -p out/timelines
	@for n in $(EXAMPLES); do \
		$(VENV)/bin/planner compile examples/$$n.py -o out/timelines/$$n.json --time-limit 10 > /dev/null && \
		$(VENV)/bin/planner timeline out/timelines/$$n.json -o out/timelines/$$n.png \
			--trace out/timelines/$$n.trace.json || exit 1; \
	done

bench: $(STAMP)
	$(PY) bench/search.py
	$(PY) bench/cost_accuracy.py
	$(PY) bench/cost_speed.py
	$(PY) bench/realloc.py
	$(PY) bench/rlhf_learning.py
	$(PY) bench/predict_vs_measure.py
	$(PY) bench/predict_vs_measure.py --example examples/tiny_ppo_moe.py
	$(PY) bench/real_job.py

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache build *.egg-info
