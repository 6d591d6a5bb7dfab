# The two commands a newcomer runs: `make demo` (the main job) and `make test`.
# Both create .venv on first use (Python 3.11, pinned packages).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test clean

demo: $(STAMP)
	$(VENV)/bin/python examples/digits_demo.py --towers 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

$(STAMP): requirements-test.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements-test.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

clean:
	rm -rf $(VENV) examples/output .pytest_cache
