# Two commands set everything up on a fresh machine (Python 3.11+):
#   make run    both services on the embedded tiny model (MODEL=/path/to/checkpoint to serve one)
#   make test   the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= tiny
# The stamp is rebuilt when the dependency list changes, so `make` after a pull
# installs what is new and nothing else.
STAMP := $(VENV)/.installed

.PHONY: run test protos bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m pagedkv.stack --model $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
