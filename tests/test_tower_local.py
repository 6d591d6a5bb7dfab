"""`replicate.tower_local_scope`: one copy per tower, reduced when read.

Each tower updates its own copy with no communication; after every training
step tower 0's variable, the one that is saved, holds the sum (or mean) over
the towers that had rows.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, TRAIN, cpus, session_config

X = np.arange(1.0, 8.0, dtype=np.float32).reshape(7, 1)  # 1, 2, ..., 7


def _model_fn(features, labels, mode):
  """Counts rows seen (sum) and keeps the last batch's mean x (mean)."""
  with replicate.tower_local_scope(reduce="sum"):
    seen = tf.compat.v1.get_variable(
        "examples_seen", [], tf.int64, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
  with replicate.tower_local_scope(reduce="mean"):
    # Made through tf.Variable, as a Keras layer would, not get_variable.
    mean_x = tf.Variable(0.0, trainable=False, name="mean_x")
  w = tf.compat.v1.get_variable("w", [1, 1],
                                initializer=tf.compat.v1.ones_initializer())
  loss = tf.compat.v1.losses.mean_squared_error(labels,
                                                tf.matmul(features, w))
  count = seen.assign_add(tf.shape(features, out_type=tf.int64)[0])
  statistic = mean_x.assign(tf.reduce_mean(features))
  minimize = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.01)).minimize(
          loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  metrics = {"seen": (tf.identity(seen), tf.group(count)),
             "mean_x": tf.compat.v1.metrics.mean(features)}
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(minimize, count, statistic),
      eval_metric_ops=metrics)


def _train(model_fn, rows, steps=2, strategy="parameter_server", towers=3):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    if towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=cpus(towers), variable_strategy=strategy)
    spec = model_fn(tf.constant(X[:rows]), tf.constant(X[:rows]), TRAIN)
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in range(steps):
        session.run(spec.train_op)
      return session.run({
          v.op.name: v for v in tf.compat.v1.global_variables() +
          tf.compat.v1.local_variables()})


@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_the_saved_variable_holds_the_sum_and_the_mean(strategy):
  values = _train(_model_fn, rows=7, strategy=strategy)
  # 7 rows a step, counted in shards of 3, 2 and 2, for 2 steps.
  assert values["examples_seen"] == 14
  # Every tower starts the next step from the total.
  assert values["tower_1/examples_seen"] == values[
      "tower_2/examples_seen"] == 14
  # Shard means (1+2+3)/3 = 2, (4+5)/2 = 4.5, (6+7)/2 = 6.5; their mean is
  # 13/3, and every copy starts the next step from it.
  for name in ("mean_x", "tower_1/mean_x", "tower_2/mean_x"):
    assert values[name] == pytest.approx(13 / 3)
  variables = {name for name in values if not name.startswith("tower_")}
  assert {"examples_seen", "mean_x"} <= variables
  assert "tower_1/examples_seen" in values  # a local copy, never saved


def _offset_model_fn(features, labels, mode):
  """Predicts x + offset, where offset is a saved sum (10 to start)."""
  with replicate.tower_local_scope(reduce="sum"):
    offset = tf.compat.v1.get_variable(
        "offset", [], trainable=False,
        initializer=tf.compat.v1.constant_initializer(10.0))
  return tf.estimator.EstimatorSpec(mode, predictions=features + offset)


def test_every_tower_reads_the_reduced_value():
  model_fn = replicate.replicate_model_fn(_offset_model_fn, devices=cpus(3))
  with tf.Graph().as_default():
    spec = model_fn(tf.constant(X), None, tf.estimator.ModeKeys.PREDICT)
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      predictions = session.run(spec.predictions)
  # Rows 1..7 on towers of 3, 2 and 2 rows: each adds the same 10.
  np.testing.assert_allclose(predictions, X + 10.0)


def test_a_tower_on_a_stand_in_row_counts_nothing():
  # 2 rows on 3 towers: tower 2 runs on a copy of row 0, which must not
  # count, nor enter the mean: shard means 1 and 2 -> 1.5.
  values = _train(_model_fn, rows=2, steps=3)
  assert values["examples_seen"] == 6
  assert values["mean_x"] == pytest.approx(1.5)


def test_one_device_and_no_wrapper_count_the_same():
  unwrapped = _train(_model_fn, rows=7, towers=1)
  assert unwrapped["examples_seen"] == 14
  assert unwrapped["mean_x"] == pytest.approx(4.0)  # mean of 1..7
  assert not any(name.startswith("tower_") for name in unwrapped)


def test_eval_folds_once_per_batch():
  model_fn = replicate.replicate_model_fn(_model_fn, devices=cpus(3))
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn(tf.constant(X), tf.constant(X), EVAL)
    value, update = spec.eval_metric_ops["seen"]
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      session.run([u for _, u in spec.eval_metric_ops.values()])
      session.run(update)
      # 7 rows per batch, two batches: the whole batch counted each time.
      assert session.run(value) == 14
      assert session.run(spec.eval_metric_ops["mean_x"][0]) == pytest.approx(
          4.0)


def _scoped_variable(reduce, **kwargs):
  def model_fn(features, labels, mode):
    with replicate.tower_local_scope(reduce=reduce):
      tf.compat.v1.get_variable("v", [], **kwargs)
    return tf.estimator.EstimatorSpec(mode, predictions=features)

  with tf.Graph().as_default():
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.constant(X), None, tf.estimator.ModeKeys.PREDICT)


@pytest.mark.parametrize("reduce, kwargs, message", [
    ("sum", {}, r"tower_local_scope: the variable 'v' is trainable\. .* "
     r"create it with trainable=False"),
    ("mean", {"dtype": tf.int64, "trainable": False},
     r"reduce='mean'\): the variable 'v' is int64, but a mean needs a "
     r"floating-point variable"),
    ("max", {}, r"tower_local_scope\(reduce=\.\.\.\) must be one of 'sum', "
     r"'mean'\. Received: 'max'"),
])
def test_bad_tower_local_variables_fail_clearly(reduce, kwargs, message):
  with pytest.raises(ValueError, match=message):
    _scoped_variable(reduce, **kwargs)


def test_a_local_variable_in_the_scope_is_refused():
  def model_fn(features, labels, mode):
    with replicate.tower_local_scope(reduce="sum"):
      tf.compat.v1.get_local_variable("v", [], trainable=False)
    return tf.estimator.EstimatorSpec(mode, predictions=features)

  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=(
        r"tower_local_scope: the variable 'v' is created in collections "
        r"\['local_variables'\] that leave out GLOBAL_VARIABLES")):
      replicate.replicate_model_fn(model_fn, devices=cpus(2))(
          tf.constant(X), None, tf.estimator.ModeKeys.PREDICT)
