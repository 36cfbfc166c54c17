# Quick start: `make demo` compiles the bundled PPO example and prints its plan; `make test` runs
# the tests. Each creates .venv when missing (torch 2.13.0 first unless torch is importable, so
# pip never pulls a multi-GB CUDA build on a CPU machine) and installs the project editable.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check bench timelines venv clean

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
	$(PY) -m pytest -q

# Static checks (configured in pyproject.toml): ruff (pyflakes, import order, bugbear) and mypy
# with the pydantic plugin over plans/ cost_models/ planner/ runtime/.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

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
	$(PY) bench/real_job.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
