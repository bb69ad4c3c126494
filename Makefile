# The two commands of the README, and a few for developers.
PYTHON ?= python3
# what runs it all: $(PYTHON), or the .venv bootstrap makes from it where the distribution
# manages $(PYTHON) and pip refuses to install into it (PEP 668: Debian 12's python3)
RUN = $(shell PYTHON='$(PYTHON)' bash scripts/python.sh)

.PHONY: demo test lint bench bootstrap

bootstrap:
	PYTHON='$(PYTHON)' bash scripts/bootstrap.sh

demo: bootstrap
	$(RUN) -m proxy demo

test: bootstrap
	$(RUN) -m ruff check proxy tests examples bench
	$(RUN) -m pytest -p no:cacheprovider -q

lint:
	$(RUN) -m ruff check proxy tests examples bench

bench:
	PYTHON='$(PYTHON)' bash scripts/bootstrap.sh --bench
	$(RUN) -m bench
