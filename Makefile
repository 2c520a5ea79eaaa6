# thinkproject tasks. `make run` serves the demo; `make test` runs linters and the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export LITELLM_LOCAL_MODEL_COST_MAP := True
# The Procfile's commands (daphne, celery, python) come from the virtualenv.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install run test lint fmt pytest migrate services clean

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -c requirements.lock -e ".[dev]"
	touch $@

install: $(VENV)/.installed

migrate: install
	$(PY) -m thinkproject.bootstrap
	$(PY) manage.py migrate --noinput

## The service: web (daphne), worker, beat and the scripted model, against Postgres and Redis.
## Web, worker and beat share one metrics directory (prometheus_client multiprocess mode), emptied first.
run: export PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/.run/metrics
run: migrate
	$(PY) -m thinkproject.bootstrap metrics
	$(BIN)/honcho start

## The tests: linters, type checks, migrations check, then pytest on real Postgres, Redis and processes.
test: install lint pytest

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .
	$(BIN)/lint-imports
	DJANGO_SETTINGS_MODULE=tests.settings $(PY) manage.py makemigrations --check --dry-run

pytest:
	$(PY) -m pytest

fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## Start local Postgres and Redis if they are not running (Debian packages).
services:
	.ci/services-up

clean:
	rm -rf $(VENV) staticfiles
