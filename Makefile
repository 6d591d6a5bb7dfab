# The two commands a newcomer runs: `make demo` (the main job) and `make test`.
# Both create .venv on first use (Python 3.11, pinned packages); `make venv`
# only creates it. The stamp file re-installs when requirements-test.txt or
# setup.py change, and does nothing otherwise.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

# Never wait for input (CI has no stdin) and skip pip's self-update notice.
export PIP_NO_INPUT := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv demo test clean

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python examples/digits_demo.py --towers 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

$(STAMP): requirements-test.txt setup.py
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "replicate needs Python 3.11 (TensorFlow 2.15); $(PYTHON) is " + sys.version.split()[0] + ". Run: make PYTHON=/path/to/python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements-test.txt
	$(VENV)/bin/python -m pip install --quiet -e .
	touch $(STAMP)

clean:
	rm -rf $(VENV) examples/output .pytest_cache *.egg-info build dist
