"""Eval metrics: every key over the whole batch, each variable folded once."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
fc = tf.feature_column

ROWS = 7
_rng = np.random.RandomState(3)
X = _rng.rand(ROWS, 3).astype(np.float32)
COLOR = np.array(list("abcdabc")).reshape(ROWS, 1)
LABEL = np.array([1, 0, 1, 1, 0, 1, 1])  # label/mean 5/7 on the batch
REPEATS = 20


def _binary(kind, family, model_dir):
  """A binary canned classifier: two keys share the label mean's variables."""
  numeric = [fc.numeric_column("x", shape=[3])]
  color = fc.categorical_column_with_vocabulary_list("color", list("abcd"))
  module = tf.estimator if family == "v2" else tf.compat.v1.estimator
  optimizer = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.Adagrad(0.1)) if family == "v2"
      else (lambda: tf.compat.v1.train.AdagradOptimizer(0.1)))
  if kind == "DNNClassifier":
    return module.DNNClassifier([4], numeric + [fc.embedding_column(color, 2)],
                                optimizer=optimizer, model_dir=model_dir)
  if kind == "LinearClassifier":
    return module.LinearClassifier(numeric + [color], optimizer=optimizer,
                                   model_dir=model_dir)
  return module.DNNLinearCombinedClassifier(
      linear_feature_columns=[color], linear_optimizer=optimizer,
      dnn_feature_columns=numeric, dnn_hidden_units=[4],
      dnn_optimizer=replicate.TowerOptimizer(
          (lambda: tf.keras.optimizers.legacy.Adam(0.01)) if family == "v2"
          else (lambda: tf.compat.v1.train.AdamOptimizer(0.01))),
      model_dir=model_dir)


def _input_fn():
  return tf.data.Dataset.from_tensor_slices(
      ({"x": X, "color": COLOR}, LABEL)).batch(ROWS)


def _evaluations(model_fn, model_dir, repeats):
  """Every key's value after one batch, `repeats` times from fresh metrics."""
  with tf.Graph().as_default():
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        _input_fn().repeat()).get_next()
    spec = model_fn(features=features, labels=labels, mode=EVAL,
                    config=tf.estimator.RunConfig(session_config=session_config()))
    updates = [update for _, update in spec.eval_metric_ops.values()]
    values = {key: value for key, (value, _) in spec.eval_metric_ops.items()}
    saver = tf.compat.v1.train.Saver()
    results = []
    with tf.compat.v1.Session(config=session_config()) as session:
      saver.restore(session, tf.train.latest_checkpoint(model_dir))
      for _ in range(repeats):
        session.run(tf.compat.v1.local_variables_initializer())
        session.run(tf.compat.v1.tables_initializer())
        session.run(updates)
        results.append(session.run(values))
  return results


@pytest.mark.parametrize("kind", ["DNNClassifier", "LinearClassifier",
                                  "DNNLinearCombinedClassifier"])
@pytest.mark.parametrize("family", ["v1", "v2"])
def test_binary_heads_report_every_key_like_one_device_every_time(
    kind, family, tmp_path):
  canned = _binary(kind, family, str(tmp_path))
  canned.train(_input_fn, steps=1)
  expected = _evaluations(canned.model_fn, str(tmp_path), 1)[0]
  assert expected["label/mean"] == pytest.approx(5 / 7)
  reduction = Reduction.SUM if family == "v1" else (
      Reduction.SUM_BY_NONZERO_WEIGHTS)
  wrapped = replicate.replicate_model_fn(canned.model_fn, devices=cpus(3),
                                         loss_reduction=reduction)
  for values in _evaluations(wrapped, str(tmp_path), REPEATS):
    assert sorted(values) == sorted(expected)
    for key, value in expected.items():
      np.testing.assert_allclose(values[key], value, rtol=1e-5, atol=1e-6,
                                 err_msg=key)


def _shared_metrics_model_fn(features, labels, mode):
  """Two keys read the same total and count, as a binary head's do."""
  del labels
  total = tf.compat.v1.get_local_variable("total", [],
                                          initializer=tf.zeros_initializer())
  count = tf.compat.v1.get_local_variable("count", [],
                                          initializer=tf.zeros_initializer())
  update = tf.group(total.assign_add(tf.reduce_sum(features["x"])),
                    count.assign_add(tf.cast(tf.size(features["x"]),
                                             tf.float32)))
  mean = tf.math.divide_no_nan(total.read_value(), count.read_value())
  loss = tf.reduce_mean(features["x"])
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, eval_metric_ops={
          "mean": (mean, update), "baseline": (1.0 - mean, update)})


@pytest.mark.parametrize("towers", [2, 3])
def test_variables_read_by_several_keys_are_folded_once(towers):
  with tf.Graph().as_default():
    x = tf.constant(np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1))
    spec = replicate.replicate_model_fn(
        _shared_metrics_model_fn, devices=cpus(towers))(
            {"x": x}, None, EVAL)
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in range(2):
        session.run([update for _, update in spec.eval_metric_ops.values()])
      mean = session.run(spec.eval_metric_ops["mean"][0])
      baseline = session.run(spec.eval_metric_ops["baseline"][0])
  # Rows 0..6 twice: mean 3.0 whatever the towers; 1 - 3.0 = -2.0.
  assert mean == pytest.approx(3.0)
  assert baseline == pytest.approx(-2.0)
