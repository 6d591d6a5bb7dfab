"""Eval metrics: every key over the whole batch, each variable folded once."""

import os

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


# `make test` takes each kind once and each family (v1 twice, whose heads
# sum); `make test-oracle` (which sets REPLICATE_ORACLE) the other three of
# the cross, whose binary heads the oracle's zoo evaluates on every tower
# count too.
_SAMPLE = (("v1", "DNNClassifier"), ("v2", "LinearClassifier"),
           ("v1", "DNNLinearCombinedClassifier"))
_BINARY = [(family, kind) for family in ("v1", "v2")
           for kind in ("DNNClassifier", "LinearClassifier",
                        "DNNLinearCombinedClassifier")
           if ((family, kind) in _SAMPLE) != bool(
               os.environ.get("REPLICATE_ORACLE"))]


@pytest.mark.parametrize("family, kind", _BINARY,
                         ids=["-".join(row) for row in _BINARY])
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


KERAS_ROWS = 10  # batches of 7 from .repeat(): rows 0-6, then 7-9 and 0-3
KERAS_X = np.random.RandomState(5).rand(KERAS_ROWS, 3).astype(np.float32)
KERAS_LABEL = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], np.float32)


def _keras_metrics_model_fn(features, labels, mode):
  """Keras metric objects in eval_metric_ops, as a TF 2 model_fn has them."""
  weights = tf.compat.v1.get_variable(
      "w", [3, 1], initializer=tf.constant_initializer([[0.5], [-1.0], [2.0]]))
  logits = tf.squeeze(tf.matmul(features["x"], weights), 1) - 1.0
  probabilities = tf.sigmoid(logits)
  per_row = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels,
                                                    logits=logits)
  metrics = {"mean": tf.keras.metrics.Mean(),
             "accuracy": tf.keras.metrics.BinaryAccuracy(),
             "auc": tf.keras.metrics.AUC(num_thresholds=50),
             "precision": tf.keras.metrics.Precision()}
  metrics["mean"].update_state(per_row)
  for key in ("accuracy", "auc", "precision"):
    metrics[key].update_state(labels, probabilities)
  return tf.estimator.EstimatorSpec(mode, loss=tf.reduce_mean(per_row),
                                    eval_metric_ops=metrics)


def _keras_input_fn(is_repeated):
  def input_fn():
    rows = tf.data.Dataset.from_tensor_slices(({"x": KERAS_X}, KERAS_LABEL))
    # repeat() makes an op named `count`: tower 0's Keras `count` variable
    # becomes `count_1`, tower 1's `tower_1/count`.
    return (rows.repeat() if is_repeated else rows).batch(7)
  return input_fn


def _evaluate(model_fn, towers, is_repeated, model_dir):
  config = tf.estimator.RunConfig(model_dir=model_dir,
                                  session_config=session_config(towers))
  return tf.estimator.Estimator(model_fn, config=config).evaluate(
      _keras_input_fn(is_repeated), steps=3 if is_repeated else None)


@pytest.mark.parametrize("is_repeated", [False, True])
@pytest.mark.parametrize("towers", [2, 3])
def test_keras_metric_objects_pair_by_creation_order(towers, is_repeated,
                                                     tmp_path):
  expected = _evaluate(_keras_metrics_model_fn, 1, is_repeated,
                       str(tmp_path / "one"))
  # Rows of 7-row batches 0-6 (and 7-9, 0-3; 4-9 with .repeat()): a fold
  # that kept tower 0's rows only would give other values.
  values = _evaluate(replicate.replicate_model_fn(_keras_metrics_model_fn),
                     towers, is_repeated, str(tmp_path / "wrapped"))
  assert sorted(values) == sorted(expected)
  for key in ("mean", "accuracy", "auc", "precision", "loss"):
    np.testing.assert_allclose(values[key], expected[key], rtol=1e-5,
                               atol=1e-6, err_msg=key)


def _one_batch_values(model_fn, rows):
  """Every key's value after one update on the first `rows` rows."""
  with tf.Graph().as_default():
    spec = model_fn({"x": tf.constant(KERAS_X[:rows])},
                    tf.constant(KERAS_LABEL[:rows]), EVAL)
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      session.run([update for _, update in spec.eval_metric_ops.values()])
      return session.run({key: value for key, (value, _)
                          in spec.eval_metric_ops.items()})


@pytest.mark.parametrize("towers", [2, 3])
def test_keras_metric_towers_without_rows_add_nothing(towers):
  # One row: tower 0 has it, towers 1.. run on a stand-in row that adds 0.
  expected = _one_batch_values(_keras_metrics_model_fn, 1)
  values = _one_batch_values(replicate.replicate_model_fn(
      _keras_metrics_model_fn, devices=cpus(towers)), 1)
  for key, value in expected.items():
    np.testing.assert_allclose(values[key], value, rtol=1e-5, atol=1e-6,
                               err_msg=key)


def _is_tower_1():
  return tf.compat.v1.get_default_graph().get_name_scope().startswith(
      "tower_1")


def _metric_variable(name, shape=()):
  """A metric variable made as Keras makes one: under the tower's scope."""
  return tf.compat.v1.Variable(
      tf.zeros(shape), trainable=False, name=name, use_resource=True,
      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _mismatched(how):
  """A model_fn whose tower 1 makes its metric differently: `how`."""

  def model_fn(features, labels, mode):
    del labels
    is_odd = _is_tower_1()
    total = _metric_variable("total", (2,) if is_odd and how == "shape"
                             else ())
    updates = [total.assign_add(tf.reduce_sum(features["x"]) +
                                tf.zeros_like(total))]
    value = tf.reduce_sum(total.read_value())
    if is_odd and how == "count":
      extra = _metric_variable("extra")
      updates.append(extra.assign_add(1.0))
      value += extra.read_value()
    return tf.estimator.EstimatorSpec(
        mode, loss=tf.reduce_mean(features["x"]),
        eval_metric_ops={"total": (value, tf.group(*updates))})

  return model_fn


@pytest.mark.parametrize("how, tower_1", [
    ("shape", "['tower_1/total: float32 (2,)']"),
    ("count", "['tower_1/total: float32 ()', 'tower_1/extra: float32 ()']")])
def test_metric_variables_that_do_not_pair_are_refused(how, tower_1):
  with tf.Graph().as_default():
    x = tf.constant(np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1))
    with pytest.raises(ValueError) as error:
      replicate.replicate_model_fn(_mismatched(how), devices=cpus(2))(
          {"x": x}, None, EVAL)
  message = str(error.value)
  assert "eval_metric_ops['total']: tower 1's metric variables " in message
  assert tower_1 in message
  assert ("do not pair, in creation order, with tower 0's "
          "['total: float32 ()']") in message
  assert "Create the metric the same way in every tower" in message


def _reordered_model_fn(features, labels, mode):
  """Tower 1 creates the two variables key 'a' reads in the other order."""
  del labels
  if _is_tower_1():
    second, first = _metric_variable("second"), _metric_variable("first")
  else:
    first, second = _metric_variable("first"), _metric_variable("second")
  update = tf.group(first.assign_add(tf.reduce_sum(features["x"])),
                    second.assign_add(1.0))
  return tf.estimator.EstimatorSpec(
      mode, loss=tf.reduce_mean(features["x"]), eval_metric_ops={
          "a": (first.read_value() + second.read_value(), update),
          "b": (second.read_value(), update)})


def test_a_variable_paired_differently_by_two_keys_is_refused():
  # Key 'a' pairs tower_1/second with tower 0's first (creation order);
  # key 'b' pairs it with second: folding both would count it twice.
  with tf.Graph().as_default():
    x = tf.constant(np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1))
    with pytest.raises(ValueError) as error:
      replicate.replicate_model_fn(_reordered_model_fn, devices=cpus(2))(
          {"x": x}, None, EVAL)
  message = str(error.value)
  assert ("tower 1's metric variable 'tower_1/second' pairs with tower 0's "
          "'first' in eval_metric_ops['a'] but with 'second' in "
          "eval_metric_ops['b']") in message
  assert "Create the metrics the same way in every tower" in message
