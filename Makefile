# tandem: `make run` starts the default cluster, `make test` runs the tests.
# Both set everything up first; setup is idempotent and quick the second time.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-stamp
CONFIG ?= configs/local.yaml
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Pytest arguments, e.g. `make test ARGS="tests/unit -x"`.
ARGS ?=

.PHONY: setup nats kernels cross-tools bench-clients model run test compose-test bench lint proto clean

setup: $(STAMP) nats kernels

# The CPU decode kernels (docs/engine.md "Decode fast path"): built once with g++ (the
# Debian package, installed where missing) into ~/.cache/tandem/kernels. A failed build
# is not a failure here: the engine then keeps torch's kernels.
kernels: $(STAMP)
	@command -v g++ >/dev/null 2>&1 || { \
		echo "installing g++ (Debian package)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; }
	@$(PY) -m services.engine.cpu_kernels.build >/dev/null || echo "CPU kernels not built: the engine uses torch's"

# The tests check the ARM (NEON) kernels on x86 too: built by Debian's aarch64 cross
# compiler, run under qemu-user (tests/unit/engine/cpu_kernels/test_kernel_harness.py).
cross-tools:
	@[ "$$(uname -m)" != x86_64 ] || { command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; } || { \
		echo "installing g++-aarch64-linux-gnu and qemu-user (Debian packages, for the NEON kernel tests)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; }

# instructor, for tests/integration/launcher/test_structured_up.py. Not in the dev extra:
# its releases (1.17.0 at most) pin jiter<0.15 and rich<15, while the openai the tests use
# needs jiter>=0.16, so pip cannot resolve both. It uses jiter only for `from_json` (partial
# JSON, in newer jiter too) and rich only in its CLI, so it is installed without its
# requirements, then those with the two stale caps lifted (the rest as it states them).
INSTRUCTOR := instructor==1.17.0
INSTRUCTOR_DEPS := 'aiohttp>=3.14.3,<4' 'click>=8.3.3' 'docstring-parser>=0.16,<1.0' 'idna>=3.15' \
	'jinja2>=3.1.4,<4' 'jiter>=0.6.1' 'openai>=2,<4' 'pydantic>=2.8,<3' 'regex>=2023' \
	'requests>=2.33,<3' 'rich>=13.7' 'tenacity>=8.2.3,<10' 'typer>=0.9,<1' 'urllib3>=2.7,<3'

# guidellm and aiperf, the load generators users benchmark a server with, for
# tests/e2e/api/test_bench_clients.py, in a venv of their own: their pins clash with ours
# (aiperf: pandas 2, pillow 12, rich 14, prometheus-client 0.23; guidellm: click 8.4).
# guidellm's data loader imports torch: the CPU build on disk first, as in $(VENV).
CLIENTS := .venv-clients
CLIENT_PINS := guidellm==0.8.1 aiperf==0.13.0

bench-clients: $(CLIENTS)/.setup-stamp

$(CLIENTS)/.setup-stamp: Makefile
	test -x $(CLIENTS)/bin/python || $(PYTHON) -m venv $(CLIENTS)
	$(CLIENTS)/bin/python -m pip install -q torch==2.13.0
	$(CLIENTS)/bin/python -m pip install -q $(CLIENT_PINS)
	touch $@

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: 2.13.0 is the CPU build already on disk; a bare `torch` pulls CUDA wheels.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,planner]'
	$(PIP) install -q --no-deps $(INSTRUCTOR)
	$(PIP) install -q $(INSTRUCTOR_DEPS)
	touch $(STAMP)

nats:
	@command -v nats-server >/dev/null 2>&1 || { \
		echo "installing nats-server (Debian package)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nats-server; }

model: $(STAMP)
	$(VENV)/bin/tandem model pull

run: setup model
	$(VENV)/bin/tandem up -c $(CONFIG)

test: setup model cross-tools bench-clients
	$(PY) -m pytest -q $(ARGS)

# The compose stack against a real Docker (deploy/compose-test.sh): builds the images,
# starts deploy/docker-compose.yaml (with compose.hostnet.yaml: no network is created),
# checks it as a user would, tears it down. Says SKIPPED where no Docker daemon can be had.
compose-test: setup
	PY=$(PY) bash deploy/compose-test.sh

bench: setup model
	$(VENV)/bin/tandem bench engine --json benchmarks/results/engine.json

lint: setup
	$(VENV)/bin/ruff check services tests benchmarks

# Regenerate services/gen from proto/ (the generated files are committed).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iservices/gen=proto --python_out=. --grpc_python_out=. \
		--pyi_out=. proto/*.proto

clean:
	rm -rf $(VENV) $(CLIENTS) .pytest_cache .ruff_cache
