# The two set-up commands of the README:
#   make demo   - build the venv if needed, run the agent on a simulated training job
#   make test   - build the venv if needed, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml setup.py $(wildcard agent/kernels/*.c agent/kernels/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/precision-agent demo

# test workers: most tests wait on a daemon subprocess or a real Prometheus, so two workers on the
# 2-core CI host halve the wall time (24.5 -> 13.5 min without the corpus); 0 runs them in this process
TEST_WORKERS ?= 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

bench: $(BIN)/.installed
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
