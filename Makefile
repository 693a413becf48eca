# The two commands of the README: `make demo` runs the bundled example job,
# `make test` runs the whole test suite. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
JOB ?= examples/digits-hybrid.yaml
# extras installed for `make test`; e.g. EXTRAS=paddle,dev for a paddle-only interpreter
EXTRAS ?= torch,paddle,dev

.PHONY: demo test venv proto clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[torch,paddle,examples,report,registry,privacy]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/hfleet run $(JOB)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

proto: $(VENV)/.installed-test
	$(BIN)/python -m hybridfleet.ps.wire.proto_gen

clean:
	rm -rf $(VENV) runs .hfleet .pytest_cache
