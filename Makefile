# mrl — the two commands a user needs are `make train` and `make test`; each sets up .venv on its own.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= mrl_configs/quickstart.yaml
ARGS   ?=
# CPU hosts pin the CPU wheel that lies on disk; the docker image brings its own CUDA torch (TORCH_SPEC=).
TORCH_SPEC ?= torch==2.13.0
IMAGE  ?= mrl:latest

.PHONY: install train test plan lint docker clean-venv quickstart-assets bench-deps

# The packages go in with uv, pip's drop-in (the same pins and resolution): it downloads in parallel and
# compiles the bytecode on every core, 1m42s -> ~45 s here (docs/running.md). uv does not read pip's config, so
# the wheel directories it names in PIP_FIND_LINKS (here: the CPU torch wheel on disk) are passed on.
# INSTALL="$(PY) -m pip install" installs with pip alone.
UV_VERSION ?= 0.13.9
INSTALL ?= $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode
$(VENV)/.installed: setup.py requirements-sglang-cpu.txt requirements-oracles.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "uv==$(UV_VERSION)"
	@if [ -n "$(TORCH_SPEC)" ]; then $(INSTALL) -q $(foreach d,$(PIP_FIND_LINKS),--find-links $(d)) "$(TORCH_SPEC)"; fi
	$(INSTALL) -q -e ".[dev]"
	@# SGLang's own code for the conformance tests, off the venv's import path (see the file's header)
	rm -rf $(VENV)/sglang-cpu
	$(INSTALL) -q --no-deps --target $(VENV)/sglang-cpu -r requirements-sglang-cpu.txt
	@# verl's and TRL's code, the oracles of tests/algorithms/oracle/ and tests/workers/test_trl_loss.py, likewise off
	@# the import path (tests/helpers/verl_oracle.py, trl_oracle.py)
	rm -rf $(VENV)/oracles
	$(INSTALL) -q --no-deps --target $(VENV)/oracles -r requirements-oracles.txt
	@touch $@

install: $(VENV)/.installed

# benchmarks/vs_trl.py's TRL side, off the venv's import path (the script adds it): setup.py's `bench`
# extra pinned, --no-deps (accelerate, pyarrow, pandas, transformers come with mrl's own install)
bench-deps: $(VENV)/.installed requirements-bench.txt
	rm -rf $(VENV)/bench-trl
	$(INSTALL) -q --no-deps --target $(VENV)/bench-trl -r requirements-bench.txt

# The quickstart's tiny model and toy dataset are generated locally (no downloads), once, and again
# (--force) when mrl/quickstarts/base.py changes: stale assets would not match the config.
QUICKSTART_ASSETS := outputs/quickstart/.assets-written
$(QUICKSTART_ASSETS): $(VENV)/.installed mrl/quickstarts/base.py
	$(PY) -m mrl.quickstarts base --out outputs/quickstart --force
	@touch $@

quickstart-assets: $(QUICKSTART_ASSETS)

# The quickstart's reward model (mrl_configs/quickstart_rm.yaml): trained on the actor's body, so
# rewritten whenever the quickstart's assets are.
QUICKSTART_RM := outputs/quickstart/.rm-written
$(QUICKSTART_RM): $(QUICKSTART_ASSETS) mrl/quickstarts/rm.py
	$(PY) -m mrl.quickstarts rm --out outputs/quickstart --force
	@touch $@

# The distillation demo's teacher (mrl_configs/quickstart_distill.yaml): the quickstart's model trained further.
QUICKSTART_DISTILL := outputs/quickstart/.teacher-written
$(QUICKSTART_DISTILL): $(QUICKSTART_ASSETS) mrl/quickstarts/distill.py
	$(PY) -m mrl.quickstarts distill --out outputs/quickstart --force
	@touch $@

# The judge quickstart's judge (mrl_configs/quickstart_judge.yaml): a causal LM fine-tuned on the
# actor's body to answer yes/no, so rewritten whenever the quickstart's assets are.
QUICKSTART_JUDGE := outputs/quickstart/.judge-written
$(QUICKSTART_JUDGE): $(QUICKSTART_ASSETS) mrl/quickstarts/judge.py
	$(PY) -m mrl.quickstarts judge --out outputs/quickstart --force
	@touch $@

AGENT_ASSETS := outputs/quickstart_agent/.assets-written
$(AGENT_ASSETS): $(VENV)/.installed mrl/quickstarts/agent.py
	$(PY) -m mrl.quickstarts agent --out outputs/quickstart_agent --force
	@touch $@

MOE_ASSETS := outputs/quickstart_moe/.assets-written
$(MOE_ASSETS): $(VENV)/.installed mrl/quickstarts/base.py mrl/quickstarts/moe.py
	$(PY) -m mrl.quickstarts moe --out outputs/quickstart_moe --force
	@touch $@

# The DeepSeek-V3- and GLM-4.5-shaped MoE quickstarts (mrl_configs/quickstart_moe_{deepseek,glm}.yaml): their own
# asset seeds and data
MOE_DEEPSEEK_ASSETS := outputs/quickstart_moe_deepseek/.assets-written
$(MOE_DEEPSEEK_ASSETS): $(VENV)/.installed mrl/quickstarts/base.py mrl/quickstarts/moe.py
	$(PY) -m mrl.quickstarts moe --family deepseek_v3 --out outputs/quickstart_moe_deepseek --force
	@touch $@

MOE_GLM_ASSETS := outputs/quickstart_moe_glm/.assets-written
$(MOE_GLM_ASSETS): $(VENV)/.installed mrl/quickstarts/base.py mrl/quickstarts/moe.py
	$(PY) -m mrl.quickstarts moe --family glm4_moe --out outputs/quickstart_moe_glm --force
	@touch $@

# The hybrid-attention quickstart (mrl_configs/quickstart_qwen3_5.yaml): a tiny Qwen3.5 in its vision-language form
QWEN3_5_ASSETS := outputs/quickstart_qwen3_5/.assets-written
$(QWEN3_5_ASSETS): $(VENV)/.installed mrl/quickstarts/base.py mrl/quickstarts/hybrid.py
	$(PY) -m mrl.quickstarts qwen3_5 --out outputs/quickstart_qwen3_5 --force
	@touch $@

# The vision-language quickstart (mrl_configs/quickstart_vlm.yaml): a tiny Qwen2.5-VL and a colour task only the picture answers
VLM_ASSETS := outputs/quickstart_vlm/.assets-written
$(VLM_ASSETS): $(VENV)/.installed mrl/quickstarts/vlm.py
	$(PY) -m mrl.quickstarts vlm --out outputs/quickstart_vlm --force
	@touch $@

# the MoE quickstart's assets of CONFIG's family
MOE_CONFIG_ASSETS = $(if $(findstring quickstart_moe_deepseek,$(CONFIG)),$(MOE_DEEPSEEK_ASSETS),$(if $(findstring quickstart_moe_glm,$(CONFIG)),$(MOE_GLM_ASSETS),$(MOE_ASSETS)))

train: $(VENV)/.installed $(if $(findstring quickstart,$(CONFIG)),$(if $(findstring quickstart_moe,$(CONFIG)),$(MOE_CONFIG_ASSETS),$(if $(findstring quickstart_qwen3_5,$(CONFIG)),$(QWEN3_5_ASSETS),$(if $(findstring quickstart_vlm,$(CONFIG)),$(VLM_ASSETS),$(QUICKSTART_ASSETS))))) \
		$(if $(findstring quickstart_rm,$(CONFIG)),$(QUICKSTART_RM)) \
		$(if $(findstring quickstart_distill,$(CONFIG)),$(QUICKSTART_DISTILL)) \
		$(if $(findstring quickstart_judge,$(CONFIG)),$(QUICKSTART_JUDGE)) \
		$(if $(findstring quickstart_agent,$(CONFIG)),$(AGENT_ASSETS))
	$(VENV)/bin/mrl train $(CONFIG) $(ARGS)

plan: $(VENV)/.installed
	$(VENV)/bin/mrl plan $(CONFIG) $(ARGS)

# TEST_WORKERS test processes (pytest-xdist), each given whole files (--dist loadfile: a file's module fixtures
# are built once) in the order tests/conftest.py sets (slow files first; xdist would otherwise start the files
# with the most tests first, leaving the long end-to-end files for last); an end-to-end run spends much of its
# time starting processes, another file's tests fill those gaps. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	@# mrl's own bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on this project's hosts) each of the
	@# suite's ~300 processes would compile the modules it imports again (~0.1 CPU-s each)
	$(PY) -m compileall -q mrl checkpoints_tools
	$(PY) -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mrl checkpoints_tools tests benchmarks

docker:
	docker build -f docker/Dockerfile -t $(IMAGE) .

clean-venv:
	rm -rf $(VENV)
