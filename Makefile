# thinkproject tasks. `make run` serves the demo; `make test` runs linters and the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export LITELLM_LOCAL_MODEL_COST_MAP := True
# The Procfile's commands (daphne, celery, python) come from the virtualenv.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install run serve test lint fmt pytest migrate services clean

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -c requirements.lock -e ".[dev]"
	touch $@

install: $(VENV)/.installed

migrate: install
	$(PY) -m thinkproject.bootstrap
	$(PY) manage.py migrate --noinput

## The service: web (daphne), worker, beat and the scripted model, against Postgres and Redis: those of
## DATABASE_URL / REDIS_URL, else those answering on 5432 / 6379, else private ones that
## thinkproject/embedded.py starts under .run/ (the database kept in .run/pgdata) and stops afterwards.
## Web, worker and beat share one metrics directory (prometheus_client multiprocess mode), emptied first.
run: export PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/.run/metrics
## The demo runs with DEBUG on (a deployment's default is off) and, unless DJANGO_SECRET_KEY is set, a
## random key of the checkout's own, made once in .run/secret_key (thinkproject/settings.py).
run serve migrate: export DJANGO_DEBUG ?= 1
run: install
	$(PY) -m thinkproject.embedded run -- $(MAKE) --no-print-directory -o $(VENV)/.installed serve

## What `make run` runs once the services are there.
serve: migrate
	$(PY) -m thinkproject.bootstrap metrics
	$(BIN)/honcho start

## The tests: linters, type checks, migrations check, then pytest on real Postgres, Redis and processes
## (the same choice as `make run`, with throwaway private servers: tests/private_servers.py).
test: install lint pytest

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .
	$(BIN)/lint-imports
	DJANGO_SETTINGS_MODULE=tests.settings $(PY) manage.py makemigrations --check --dry-run

## Both cores: two pytest-xdist runners, a test file each at a time (a file's stacks stay on its runner),
## each with its own run id, database, queues and prefixes (tests/settings.py). docs/testing.md.
PYTEST_WORKERS ?= 2
pytest:
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## Start local Postgres and Redis if they are not running (Debian packages).
services:
	.ci/services-up

clean:
	rm -rf $(VENV) staticfiles
