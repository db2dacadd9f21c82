# Set-up and entry points. Everything the project needs is installed from here, into .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, pinned: a bare "torch" requirement pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test test-slow bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[all,dev]" "$(TORCH_PIN)"

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/python benchmarks/run.py --suite foundation --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
