# Set-up and entry points. Everything the project needs is installed from here, into .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, pinned: a bare "torch" requirement pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: setup system-deps demo test test-slow bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[all,dev]" "$(TORCH_PIN)"

demo: setup
	$(BIN)/python examples/demo.py

# System packages the tests need: nginx (real HTTP Range downloads of update channels), chromium and
# chromium-driver (luopan report's page in a real browser). Installed with apt when
# missing and running as root (CI); otherwise a note, and those tests say why they skip.
system-deps:
	@if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; \
	  else echo "note: nginx is missing (apt-get install nginx-light): the update-channel tests will skip"; fi; \
	fi
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else echo "note: chromium or chromedriver is missing (apt-get install chromium chromium-driver): the report browser tests will skip"; fi; \
	fi

test: setup system-deps
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow
	LUOPAN_POWERLOSS_STATES=$${LUOPAN_POWERLOSS_STATES:-1000} LUOPAN_FAULTS_ALL=$${LUOPAN_FAULTS_ALL:-1} $(BIN)/python -m pytest -q tests/test_powerloss*.py tests/test_fault_injection*.py

bench: setup
	$(BIN)/python benchmarks/run.py --suite foundation --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
