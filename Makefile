# The two commands of the README: `make demo` runs the bundled example job,
# `make test` runs the whole test suite. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
JOB ?= examples/digits-hybrid.yaml
# extras installed for `make test`; e.g. EXTRAS=paddle,dev for a paddle-only interpreter
EXTRAS ?= torch,paddle,dev

# The bulk plane's native TLS (hybridfleet.ps.wire._tls) links this OpenSSL statically, with
# its symbols hidden, when it has been built (.ci/install-openssl.sh: 3.5, whose AES-GCM uses
# VAES, into $HFLEET_OPENSSL_PREFIX or /opt/hybridfleet/openssl); otherwise the system's
# libssl-dev. OPENSSL_PREFIX= (empty) links the system's at the next install.
OPENSSL_PREFIX ?= $(patsubst %/.built,%,$(wildcard $(or $(HFLEET_OPENSSL_PREFIX),/opt/hybridfleet/openssl)/.built))
ifneq ($(strip $(OPENSSL_PREFIX)),)
export CPPFLAGS := -I$(OPENSSL_PREFIX)/include $(CPPFLAGS)
export LDFLAGS := -L$(OPENSSL_PREFIX)/lib -Wl,--exclude-libs,ALL $(LDFLAGS)
# a newer OpenSSL build reinstalls, so the extension is linked against it
OPENSSL_STAMP := $(OPENSSL_PREFIX)/.built
endif

.PHONY: demo test venv proto clean bench-streaming-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-demo: pyproject.toml $(OPENSSL_STAMP) | $(BIN)/python
	$(BIN)/pip install -q -e '.[torch,paddle,examples,report,registry,privacy]'
	touch $@

$(VENV)/.installed-test: pyproject.toml $(OPENSSL_STAMP) | $(BIN)/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/hfleet run $(JOB)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# MosaicML Streaming, bench/data.py's third anchor, pins packages against this project's:
# its own venv, found there by the bench (or pass --streaming-python).
MDS_VENV ?= .venv-mds
bench-streaming-venv: $(MDS_VENV)/bin/python

$(MDS_VENV)/bin/python:
	$(PY) -m venv $(MDS_VENV)
	$(MDS_VENV)/bin/pip install -q torch==2.13.0 mosaicml-streaming==0.13.0

proto: $(VENV)/.installed-test
	$(BIN)/python -m hybridfleet.ps.wire.proto_gen

clean:
	rm -rf $(VENV) runs .hfleet .pytest_cache
