"""The oracle: each cell of the zoo's cross, wrapped, against the unwrapped
`model_fn` (see oracle_harness.py for what a cell compares).

`make test` runs a pairwise-covering sample of the cross (every pair of
factor values in at least one cell); `make test-oracle`
(REPLICATE_ORACLE=full) runs the whole cross. No cell is marked xfail: a
cell equals the oracle, is refused as `EXPECTED_REFUSALS` publishes, or
fails.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import oracle_harness as harness
import oracle_pairwise
import oracle_zoo
import oracle_zoo_losses
from oracle_zoo import ZOO

# "full": the whole cross (`make test-oracle-full`); "ci": the cross less
# what the sample covers for it (`make test-oracle`, harness.ci_cells);
# else the pairwise sample (`make test`).
ORACLE = os.environ.get("REPLICATE_ORACLE")
IS_FULL = ORACLE == "full"
CELLS = (harness.ci_cells() if ORACLE == "ci" else
         harness.cells(full=IS_FULL))
if os.environ.get("REPLICATE_ORACLE_SHARD"):  # `make test-oracle`: 2 at once
  CELLS = harness.shard(CELLS, os.environ["REPLICATE_ORACLE_SHARD"])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
  shared = harness.Workspace(tmp_path_factory.mktemp("oracle"))
  yield shared
  shared.close()


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_wrapped_cell_equals_the_unwrapped_model_fn(cell, workspace,
                                                    tmp_path):
  harness.check(cell, workspace, tmp_path)


def test_the_sample_covers_every_pair_of_factor_values():
  sample = [vars(cell) for cell in harness.cells(full=False)]
  everything = [vars(cell) for cell in harness.cells(full=True)]
  # Every pair the full cross holds; a restricted model's other values
  # (`ZooModel.only`) are in no cell of either.
  in_the_cross = lambda pair: any(
      all(row[name] == value for name, value in pair) for row in everything)
  assert [pair for pair in oracle_pairwise.uncovered_pairs(
      harness.FACTORS, sample) if in_the_cross(pair)] == []
  assert len(sample) < len(everything)
  for model in ZOO:  # a restricted model gets each of its values
    for name, values in harness.model_factors(model):
      assert {row[name] for row in sample if row["model"] == model} == set(
          values), (model, name)
  assert {cell["model"] for cell in sample
          if cell["mode"] == "train" and cell["towers"] != "1"} == set(ZOO)


def test_shards_split_the_cells_by_model_and_pipeline_and_lose_none():
  everything = harness.cells(full=True)
  first, second = (harness.shard(everything, spec) for spec in ("0/2", "1/2"))
  assert len(first) + len(second) == len(everything)
  pairs = lambda cells: {(cell.model, cell.pipeline) for cell in cells}
  assert not pairs(first) & pairs(second)
  # Every model with more than one pipeline in both halves: the heavy ones
  # spread over the two.
  spread = {model for model in ZOO
            if len(dict(harness.model_factors(model))["pipeline"]) > 1}
  assert spread <= {cell.model for cell in first} & {
      cell.model for cell in second}
  with pytest.raises(ValueError, match="REPLICATE_ORACLE_SHARD must be"):
    harness.shard(everything, "2/2")


def test_pairwise_on_three_binary_factors_is_the_four_row_array():
  # Rows by hand: (0,0) first; C=0 ties, the first value wins. Then (A0,B1):
  # C=1 covers (A0,C1) and (B1,C1). Then (A1,B0): C=1 covers two, C=0 one.
  # Then (A1,B1): C=0 covers (A1,C0) and (B1,C0). Four rows, all 12 pairs.
  factors = [("a", [0, 1]), ("b", [0, 1]), ("c", [0, 1])]
  rows = oracle_pairwise.pairwise(factors)
  assert [(r["a"], r["b"], r["c"]) for r in rows] == [
      (0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
  assert oracle_pairwise.uncovered_pairs(factors, rows) == []


def test_the_zoo_has_every_pattern_and_at_least_38_models():
  assert len(ZOO) >= 38
  for name in ("clip_after_compute_gradients", "deepfm_contrib_batch_norm",
               "seeded_from_initial_values", "transformer_padded_xent",
               "bert_clip_active", "nmt_clip_after_tf_gradients",
               "terms_of_different_denominators",
               "metrics_mean_of_loss", "corpus_metric_tpu_spec",
               "in_batch_negatives_all_rows", "tagger_per_token",
               "decoder_stops_when_its_rows_are_done"):
    assert name in ZOO, name
  assert not ZOO["seeded_from_initial_values"].warm_start
  canned = [name for name in ZOO if name.startswith("canned_")]
  for part in ("v1", "v2", "_dnn_", "_linear_", "_dnn_linear_", "binary",
               "multiclass", "regressor", "weighted"):
    assert any(part in name for name in canned), part
  assert any(not name.endswith("weighted") for name in canned)
  for reduction in ("sum_by_nonzero_weights", "mean", "sum_over_batch_size",
                    "sum"):
    assert "v1_losses_weights_" + reduction in ZOO, reduction
  for reduction in ("auto", "sum_over_batch_size", "sum", "none"):
    assert "keras_loss_sample_weight_" + reduction in ZOO, reduction


def test_expected_refusals_name_models_and_factor_values():
  values = dict(harness.FACTORS)
  for (model, condition), message in harness.EXPECTED_REFUSALS.items():
    assert model == "*" or model in ZOO, model
    assert message
    if condition != "*":
      for term in condition.split("&"):
        name, value = term.split("=", 1)
        assert value in values[name], term


@pytest.mark.parametrize("name,model_fn,clip_norm", [
    ("clip_after_compute_gradients", oracle_zoo.clipped_model_fn,
     oracle_zoo.CLIP_NORM),
    ("bert_clip_active", oracle_zoo.bert_model_fn, oracle_zoo.BERT_CLIP_NORM),
    ("nmt_clip_after_tf_gradients", oracle_zoo_losses.nmt_model_fn,
     oracle_zoo_losses.NMT_CLIP_NORM)])
def test_the_zoos_clips_are_active_on_one_device(
    name, model_fn, clip_norm, workspace):
  """The models that clip after compute_gradients or after their own
  tf.gradients clip: from the oracle's start, one device's global gradient
  norm exceeds their clip norm on every batch of their cells (3 rows, the
  remainder's 1, and 3_small's 2)."""
  model = ZOO[name]
  start = tf.train.latest_checkpoint(workspace.start(model))
  (key, features), = model.data[0].items()
  labels = model.data[1]
  with tf.Graph().as_default():
    inputs = tf.compat.v1.placeholder(tf.int64, [None, 5])
    targets = tf.compat.v1.placeholder(tf.int64, [None] + list(
        labels.shape[1:]))
    tf.compat.v1.train.get_or_create_global_step()
    arguments = {"params": {}} if name.startswith("bert") else {}
    spec = model_fn({key: inputs}, targets, tf.estimator.ModeKeys.EVAL,
                    **arguments)
    norm = tf.linalg.global_norm(tf.gradients(
        spec.loss, tf.compat.v1.trainable_variables()))
    with tf.compat.v1.Session() as session:
      tf.compat.v1.train.Saver().restore(session, start)
      norms = [session.run(norm, {inputs: features[rows],
                                  targets: labels[rows]})
               for rows in (slice(0, 3), slice(3, 6), slice(6, 7),
                            slice(0, 2))]
  assert min(norms) > clip_norm, norms


def test_the_ci_cross_leaves_out_only_what_the_sample_covers_for_it():
  everything = harness.cells(full=True)
  ci = harness.ci_cells()
  assert set(map(str, ci)) < set(map(str, everything))
  left_out = [cell for cell in everything if cell not in ci]
  # One tower; 2 towers but for training on the plain batch; towers
  # without rows fed by the fed pipelines in training; evaluation and
  # prediction but on towers without rows; a mode other than train with a
  # strategy other than the model's first; an export on other towers than 3
  # or another pipeline than the plain batch; training on a fed pipeline
  # with another strategy than the model's first.
  for cell in left_out:
    first = dict(harness.model_factors(cell.model))["strategy"][0]
    assert (cell.towers == "1" or
            (cell.towers == "2" and (cell.mode != "train" or
                                     cell.pipeline != "batch")) or
            (cell.mode == "train" and cell.towers == "3_small" and
             cell.pipeline in ("repeat", "numpy_input_fn", "tf_example")) or
            (cell.mode in ("eval", "predict") and cell.towers != "3_small")
            or (cell.mode != "train" and cell.strategy != first) or
            (cell.mode == "export" and (cell.towers != "3" or
                                        cell.pipeline != "batch")) or
            (cell.mode == "train" and cell.strategy != first and
             cell.pipeline in ("repeat", "numpy_input_fn", "tf_example"))
            ), str(cell)
  # Every training cell of 3 uneven towers stays (on the fed pipelines
  # with the model's first strategy), and evaluation and prediction on
  # towers without rows with the model's first strategy.
  for cell in everything:
    first = dict(harness.model_factors(cell.model))["strategy"][0]
    fed = cell.pipeline in ("repeat", "numpy_input_fn", "tf_example")
    if (cell.mode == "train" and cell.towers == "3" and
        (not fed or cell.strategy == first)) or (
            cell.mode in ("eval", "predict") and cell.towers == "3_small" and
            cell.strategy == first):
      assert cell in ci, str(cell)
  # Every model keeps each of its modes.
  assert ({(c.model, c.mode) for c in everything if c.towers != "1"} ==
          {(c.model, c.mode) for c in ci})
