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

# The second test run: the same library under TensorFlow 1 behaviour
# (tf.compat.v1.disable_v2_behavior(), switched on in tests/conftest.py), as
# a model still written for TF 1 runs it. The part of the suite that builds
# and compares whole models: equivalence, replicated, the
# compat.v1 canned estimators on 3 towers (uneven batch, empty tower) and
# their export, sharding, specs, the model_fn's arguments, synchronized
# batch norm, seeded starts, TPUEstimatorSpec (BERT-family code is TF 1
# code) and the rows rule's op types (v1 control flow, ref variables). TF 2
# canned estimators are TF 2 code and are
# left to the first run.
TF1_TESTS := tests/test_tf1_behavior.py tests/test_equivalence.py \
	tests/test_replicated.py tests/test_canned.py tests/test_model_fn.py \
	tests/test_specs.py tests/test_sharding.py tests/test_sync_batch_norm.py \
	tests/test_seeded_start.py tests/test_tpu_spec.py tests/test_row_ops.py \
	tests/test_batch_predictions.py tests/test_loop_rows.py \
	tests/test_batch_summaries.py
TF1_SELECTION := not v2 and not v1-1 and not v1-2

.PHONY: venv demo test test-oracle test-oracle-full test-multiworker clean

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python examples/digits_demo.py --towers 2

# Both runs always run; either one failing fails `make test`. The first also
# runs benchmarks/'s tests (fast: no timing): test_benchmarks.py checks
# docs/benchmarks.md's figures against benchmarks/RESULTS.md, test_layout.py
# that benchmarks/ has no import cycle and that each command's --help comes
# before TensorFlow's import; tests/ itself never imports benchmarks/.
#
# Two processes at once, as `make test-oracle` (graph building is one
# Python thread; the machines have 2 cores): the files of TEST_FIRST, then
# the TF 1 run, in one; every other file of the first run in the other (a
# new file lands there). A module stays whole in one process, its module
# fixtures built once. test_reliability.py comes first in a fresh process:
# it measures the memory 200 graph builds leave, which depends on what the
# process ran before (after the oracle's sample it grew by 42 MB against
# its 40 MB bound). The files that open ports (clusters, the launcher, the
# docs' cluster programs and the examples' demos under it,
# test_sync_batch_norm's ps server, run again under TF 1) are all in the
# first, so no two of them run at once; with them, the heaviest builders
# of canned estimators and loss cases, by their measured
# durations (docs/testing.md), so that the two take about as long. Each
# process has its own --basetemp and no cache (the other may be copying the
# checkout: test_packaging.py). The second shows its progress; the first's
# report follows it.
TEST_FIRST := tests/test_reliability.py tests/test_cluster.py \
	tests/test_docs.py tests/test_examples.py tests/test_launch.py \
	tests/test_multiworker.py tests/test_sync_batch_norm.py \
	tests/test_sync_cluster.py tests/test_canned.py tests/test_metrics.py \
	tests/test_loss_rule.py tests/test_equivalence.py \
	tests/test_placement.py
TEST_CLUSTERS := tests/test_sync_multiworker.py tests/test_hybrid_cluster.py
PYTEST = $(VENV)/bin/python -m pytest -q -p no:cacheprovider

test: $(STAMP)
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/replicate-test.XXXXXX"); \
	( status=0; \
	  $(PYTEST) --basetemp=$$tmp/first $(TEST_FIRST) || status=1; \
	  echo "== again under TensorFlow 1 behaviour (REPLICATE_TF1_BEHAVIOR=1) =="; \
	  REPLICATE_TF1_BEHAVIOR=1 $(PYTEST) --basetemp=$$tmp/tf1 $(TF1_TESTS) \
		-k "$(TF1_SELECTION)" || status=1; \
	  exit $$status ) > $$tmp/first.log 2>&1 & first=$$!; \
	$(PYTEST) --basetemp=$$tmp/second tests benchmarks \
		$(addprefix --ignore=,$(TEST_CLUSTERS) $(TEST_FIRST)); \
	second=$$?; wait $$first; first=$$?; \
	echo "== the other process: TEST_FIRST, then TensorFlow 1 behaviour =="; \
	cat $$tmp/first.log; rm -rf $$tmp; \
	test $$first -eq 0 && test $$second -eq 0

# The oracle's cross (tests/oracle: every zoo model x pipeline x towers x
# variable_strategy x mode against the unwrapped model_fn; `make test` runs
# a pairwise-covering sample of it), in two processes at once, each half
# the (model, pipeline) pairs (graph building is one Python thread; the
# machines have 2 cores). `make test-oracle` (in .ci/run) leaves out what
# the sample covers for it (oracle_harness.ci_cells: one tower, 2 towers
# but for training on the plain batch, towers without rows on the fed
# pipelines in training, evaluation and prediction but on towers without
# rows, the other strategies of evaluation, prediction and export, an
# export's other tower counts and pipelines, the fed pipelines' other
# strategies in training); `make test-oracle-full` runs every cell.
# The second shows progress; the first's report follows it.
ORACLE_TMP ?= /tmp/replicate-oracle
ORACLE ?= ci
ORACLE_RUN = REPLICATE_ORACLE=$(ORACLE) $(VENV)/bin/python -m pytest -q \
	-p no:cacheprovider tests/oracle
# Two crosses of canned estimators whose sample `make test` keeps, the rest
# here (REPLICATE_ORACLE set): test_canned's 1 and 2 towers, and
# test_metrics' binary heads of the other three (family, kind) pairs; one
# to each process.
ORACLE_CANNED := \
	tests/test_canned.py::test_wrapped_trains_evaluates_and_predicts_like_unwrapped
ORACLE_METRICS := \
	tests/test_metrics.py::test_binary_heads_report_every_key_like_one_device_every_time

test-oracle-full:
	$(MAKE) test-oracle ORACLE=full

test-oracle: $(STAMP)
	@mkdir -p $(ORACLE_TMP); \
	REPLICATE_ORACLE_SHARD=0/2 $(ORACLE_RUN) $(ORACLE_CANNED) \
		--basetemp=$(ORACLE_TMP)/0 > $(ORACLE_TMP)/shard-0.log 2>&1 & \
	first=$$!; \
	REPLICATE_ORACLE_SHARD=1/2 $(ORACLE_RUN) $(ORACLE_METRICS) \
		--basetemp=$(ORACLE_TMP)/1; \
	second=$$?; wait $$first; first=$$?; \
	echo "== the other half of the cross (REPLICATE_ORACLE_SHARD=0/2) =="; \
	cat $(ORACLE_TMP)/shard-0.log; \
	test $$first -eq 0 && test $$second -eq 0

# Synchronous training across tasks: loopback clusters of 2 and 3 processes
# against one device, and the faults with their time bounds
# (tests/test_sync_multiworker.py); the same with ps tasks holding what the
# model_fn partitions (tests/test_hybrid_cluster.py). -rP prints each
# fault's time to exit and the tasks' memory. What each target takes, as
# measured: docs/testing.md.
test-multiworker: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -rP \
		tests/test_sync_multiworker.py tests/test_hybrid_cluster.py

$(STAMP): requirements-test.txt setup.py
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "replicate needs Python 3.11 (TensorFlow 2.15); $(PYTHON) is " + sys.version.split()[0] + ". Run: make PYTHON=/path/to/python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements-test.txt
	@# A .venv made before the rename to replicate-model-fn has this checkout as
	@# `replicate`, whose import hook would stay beside replicate-model-fn's;
	@# under that name it can otherwise only be the unrelated API client.
	@if $(VENV)/bin/python -m pip show --quiet replicate >/dev/null 2>&1; then \
		$(VENV)/bin/python -m pip uninstall --quiet --yes replicate; fi
	@# setuptools' "Editable installation" notice warns that a folder named
	@# like the package in the working directory is imported first: here
	@# that folder is this checkout's `replicate`, the one installed.
	PYTHONWARNINGS="ignore:Editable installation" \
		$(VENV)/bin/python -m pip install --quiet -e .
	touch $(STAMP)

# Build artifacts too: pip wheel / pip install . leave build/ and
# replicate_model_fn.egg-info/ here, and build/lib would ship a stale copy
# of a module since deleted.
clean:
	rm -rf $(VENV) examples/output .pytest_cache *.egg-info .eggs build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
