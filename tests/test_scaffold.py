"""A model_fn's own `Scaffold(local_init_op=...)` keeps working with towers.

The user's `local_init_op` is built in tower 0, before towers 1..N-1 exist,
so it cannot cover their metric variables, lookup tables or replicated
copies; the combined Scaffold initialises those too.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import checkpoint_values, session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers
_rng = np.random.RandomState(6)
X = _rng.rand(ROWS, 3).astype(np.float32)
COLOR = np.array(list("rgbrgbr")).reshape(ROWS, 1)
CLASS = np.array(["yes", "no", "yes", "yes", "no", "no", "yes"])


def _model_fn(features, labels, mode):
  # A table: its initializer is a local init op, as in feature columns.
  classes = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(["no", "yes"], [0, 1], tf.string,
                                          tf.int64), -1)
  color_ids = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(["r", "g", "b"], [0, 1, 2],
                                          tf.string, tf.int64), -1)
  inputs = tf.concat([features["x"], tf.one_hot(
      color_ids.lookup(features["color"][:, 0]), 3)], axis=1)
  logits = tf.compat.v1.layers.dense(
      inputs, 2, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.3, 0.3, 12).reshape(6, 2)))
  ids = classes.lookup(labels)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(ids, logits)
  # A metric built in every mode, TRAIN included: local variables per tower.
  accuracy = tf.compat.v1.metrics.accuracy(ids, tf.argmax(logits, axis=1))
  train_op = None
  if mode == tf.estimator.ModeKeys.TRAIN:
    train_op = tf.group(replicate.TowerOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step()),
                        accuracy[1])
  scaffold = tf.compat.v1.train.Scaffold(local_init_op=tf.group(
      tf.compat.v1.tables_initializer(),
      tf.compat.v1.local_variables_initializer()))
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, scaffold=scaffold,
      eval_metric_ops={"accuracy": accuracy})


def _input_fn():
  return tf.data.Dataset.from_tensors(
      ({"x": X, "color": COLOR}, CLASS)).repeat(3)


def _outcome(model_fn, towers, model_dir):
  estimator = tf.estimator.Estimator(
      model_fn, model_dir=model_dir,
      config=tf.estimator.RunConfig(session_config=session_config(towers)))
  estimator.train(_input_fn)
  # Twice: the second run restores, then initialises the copies again.
  estimator.train(_input_fn)
  return estimator.evaluate(_input_fn), checkpoint_values(model_dir)


@pytest.fixture(scope="module")
def unwrapped(tmp_path_factory):
  return _outcome(_model_fn, 1, str(tmp_path_factory.mktemp("unwrapped")))


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_a_custom_local_init_op_trains_and_evaluates_like_unwrapped(
    unwrapped, towers, strategy, tmp_path):
  metrics, variables = unwrapped
  assert metrics["global_step"] == 6
  got_metrics, got_variables = _outcome(replicate.replicate_model_fn(
      _model_fn, variable_strategy=strategy), towers, str(tmp_path))
  assert sorted(got_variables) == sorted(variables)
  for name, value in variables.items():
    np.testing.assert_allclose(got_variables[name], value, rtol=1e-5,
                               atol=1e-6, err_msg=name)
  assert got_metrics["global_step"] == 6
  np.testing.assert_allclose(got_metrics["loss"], metrics["loss"], rtol=1e-5)
  assert got_metrics["accuracy"] == metrics["accuracy"]
