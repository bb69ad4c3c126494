# The two commands of the README, and a few for developers.
PYTHON ?= python3

.PHONY: demo test lint bench bootstrap

bootstrap:
	bash scripts/bootstrap.sh

demo: bootstrap
	$(PYTHON) -m proxy demo

test: bootstrap
	$(PYTHON) -m ruff check proxy tests examples bench
	$(PYTHON) -m pytest -p no:cacheprovider -q

lint:
	$(PYTHON) -m ruff check proxy tests examples bench

bench:
	bash scripts/bootstrap.sh --bench
	$(PYTHON) -m bench
