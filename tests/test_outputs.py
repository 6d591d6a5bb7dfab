"""Predictions and export outputs that are not batch-major.

A value that does not depend on the rows comes back whole, as unwrapped; a
reduction over the rows is the whole batch's; any other value computed from
the rows without a batch dimension (a median) is refused in `predictions`
and never breaks `predict()` from `export_outputs`.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import PREDICT, cpus, session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers
X = np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1)


def _model_fn(features, labels, mode):
  """Batch-major scores, plus class names and a temperature for every row."""
  del labels
  temperature = tf.compat.v1.get_variable(
      "temperature", [2], initializer=tf.compat.v1.constant_initializer(
          [2.0, 4.0]))
  scores = features["x"] / temperature  # [batch, 2]
  return tf.estimator.EstimatorSpec(
      mode,
      predictions={"scores": scores,
                   "class_names": tf.constant(["cat", "dog", "bird"]),
                   "temperature": temperature * 1.0},
      export_outputs={
          "serving_default": tf.estimator.export.PredictOutput(
              {"scores": scores}),
          # What one device computes over the whole batch: no batch dimension.
          "stats": tf.estimator.export.PredictOutput(
              {"mean_score": tf.reduce_mean(scores),
               "median_score": _median(scores),
               "class_names": tf.constant(["cat", "dog", "bird"])}),
      })


def _run(model_fn, towers, fetch):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn({"x": tf.constant(X)}, None, PREDICT)
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(fetch(spec))


def _wrapped(towers, model_fn=_model_fn):
  return replicate.replicate_model_fn(model_fn, devices=cpus(towers))


@pytest.mark.parametrize("towers", [2, 3])
def test_values_that_do_not_depend_on_the_rows_come_back_whole(towers):
  expected = _run(_model_fn, 1, lambda spec: spec.predictions)
  assert list(expected["class_names"]) == [b"cat", b"dog", b"bird"]
  np.testing.assert_array_equal(expected["temperature"], [2.0, 4.0])
  # Row r: [r / 2, r / 4].
  np.testing.assert_array_equal(expected["scores"][:, 1], np.arange(ROWS) / 4)
  got = _run(_wrapped(towers), towers, lambda spec: spec.predictions)
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("towers", [2, 3])
def test_an_export_output_without_rows_does_not_break_predictions(towers):
  fetch = lambda spec: (spec.predictions["scores"], spec.export_outputs[
      "stats"].outputs["class_names"], spec.export_outputs[
          "serving_default"].outputs["scores"])
  scores, class_names, exported_scores = _run(_model_fn, 1, fetch)
  got_scores, got_names, got_exported = _run(_wrapped(towers), towers, fetch)
  np.testing.assert_array_equal(got_scores, scores)
  np.testing.assert_array_equal(got_exported, exported_scores)
  assert list(got_names) == list(class_names) == [b"cat", b"dog", b"bird"]
  # A reduction over the rows is the whole batch's; so is a median of the
  # whole batch, computed once on the whole batch's rows (on f65e512 the
  # multi-tower graph had no value for it, and asking for it failed).
  for key in ("mean_score", "median_score"):
    fetch = lambda spec, key=key: spec.export_outputs["stats"].outputs[key]
    assert _run(_wrapped(towers), towers, fetch) == pytest.approx(
        _run(_model_fn, 1, fetch), rel=1e-6)


@pytest.mark.parametrize("towers", [2, 3])
def test_estimator_predict_ignores_an_export_output_without_rows(
    towers, tmp_path):
  results = []
  for model_fn, count in ((_model_fn, 1), (_wrapped(towers), towers)):
    estimator = tf.estimator.Estimator(
        model_fn, model_dir=str(tmp_path / str(count)),
        config=tf.estimator.RunConfig(session_config=session_config(count)))
    results.append(list(estimator.predict(
        lambda: tf.data.Dataset.from_tensors({"x": X}),
        predict_keys=["scores"])))
  unwrapped, wrapped = results
  assert len(wrapped) == len(unwrapped) == ROWS
  for got, expected in zip(wrapped, unwrapped):
    np.testing.assert_array_equal(got["scores"], expected["scores"])


def _median(x):
  """A value over the rows that is no reduction: nothing to combine."""
  ordered = tf.sort(tf.reshape(x, [-1]))
  return ordered[tf.size(ordered) // 2]


def test_a_prediction_that_is_no_reduction_over_the_rows_is_refused(graph):
  def model_fn(features, labels, mode):
    del labels
    # The square root of a sum over the rows: made from a reduction, not one.
    return tf.estimator.EstimatorSpec(
        mode, predictions={"norm": tf.norm(features["x"] * 2.0)})

  with pytest.raises(ValueError, match=r"predictions\['norm'\] is "
                     r"computed from each tower's rows but is a scalar.*"
                     r"Return a value with one row per input row"):
    _wrapped(2, model_fn)({"x": tf.constant(X)}, None, PREDICT)


def _reduced(features, labels, mode):
  del labels
  logits = tf.concat([features["x"], -features["x"]], axis=1)
  # Shape [2], not [batch, ...]: one value per class; and a scalar.
  return tf.estimator.EstimatorSpec(mode, predictions={
      "per_class": tf.reduce_mean(logits, axis=0),
      "mean_logit": tf.reduce_mean(features["x"] * 2.0)})


@pytest.mark.parametrize("towers", [2, 3])
def test_a_prediction_reduced_over_the_batch_axis_is_the_whole_batch_s(
    towers):
  """Refused on 6b12641 (a batch of known size; of unknown size it came
  back with the towers' values concatenated: tests/test_batch_levels.py)."""
  expected = _run(_reduced, 1, lambda spec: spec.predictions)
  got = _run(_wrapped(towers, _reduced), towers, lambda spec: spec.predictions)
  np.testing.assert_allclose(expected["per_class"], [3.0, -3.0])
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)


def _folded_shape_model_fn(features, labels, mode):
  """Predictions tied to the rows only through the batch's static shape."""
  del labels
  # With a static batch TensorFlow folds these shapes to constants, so no
  # data input leads back to the rows; `zeros_like` is that constant itself,
  # as a feature passed through is the shard itself.
  return tf.estimator.EstimatorSpec(
      mode, predictions={"zeros": tf.zeros_like(features["x"]),
                         "threes": tf.fill(tf.shape(features["x"])[:1], 3.0),
                         "x": features["x"]})


@pytest.mark.parametrize("towers", [2, 3])
def test_predictions_tied_to_the_rows_by_a_folded_shape_keep_every_row(
    towers):
  expected = _run(_folded_shape_model_fn, 1, lambda spec: spec.predictions)
  np.testing.assert_array_equal(expected["zeros"], np.zeros([ROWS, 1]))
  np.testing.assert_array_equal(expected["threes"], np.full([ROWS], 3.0))
  np.testing.assert_array_equal(expected["x"], X)
  # Tower 0's shard has 4 (2 towers) or 3 (3 towers) of the 7 rows: its
  # value alone would be short of rows.
  got = _run(_wrapped(towers, _folded_shape_model_fn), towers,
             lambda spec: spec.predictions)
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    assert got[key].shape == value.shape, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)
