"""Tower i's variables are tower 0's, matched by creation, not by a name lookup.

Models that make variables with `tf.Variable` (no `get_variable`) under
default names (`Variable`, `Variable_1`) or one name twice (`w`, `w_1`) must
give every tower tower 0's variable created at the same point.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import PREDICT, TRAIN, cpus, session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers


def _four_variables_model_fn(features, labels, mode):
  del labels
  unnamed = tf.Variable(10.0)  # 'Variable'
  unnamed_too = tf.Variable(20.0)  # 'Variable_1'
  named = tf.Variable(30.0, name="w")  # 'w'
  named_again = tf.Variable(0.0, name="w")  # uniquified to 'w_1'
  return tf.estimator.EstimatorSpec(mode, predictions=tf.stack(
      [unnamed + features, unnamed_too + features, named + features,
       named_again * features], axis=1))


def _predictions(model_fn, towers):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn(tf.ones([ROWS]), None, PREDICT)
    names = sorted(v.op.name for v in tf.compat.v1.global_variables())
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(spec.predictions), names


@pytest.mark.parametrize("towers", [2, 3])
def test_unnamed_and_same_named_variables_are_tower0s_in_order(towers):
  expected, names = _predictions(_four_variables_model_fn, 1)
  # Every row: 10 + 1, 20 + 1, 30 + 1, 0 * 1.
  np.testing.assert_array_equal(expected, [[11, 21, 31, 0]] * ROWS)
  got, wrapped_names = _predictions(replicate.replicate_model_fn(
      _four_variables_model_fn, devices=cpus(towers)), towers)
  np.testing.assert_array_equal(got, expected)
  assert wrapped_names == names == [
      "Variable", "Variable_1", "global_step", "w", "w_1"]


def _tutorial_model_fn(features, labels, mode):
  """The TF 1 tutorial's softmax regression, variables by tf.Variable."""
  weights = tf.Variable(tf.zeros([3, 2]))
  bias = tf.Variable(tf.zeros([2]))
  logits = tf.matmul(features, weights) + bias
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_tutorial(model_fn, towers, steps=3):
  rng = np.random.RandomState(7)
  x = rng.rand(ROWS, 3).astype(np.float32)
  y = (x[:, 0] > x[:, 1]).astype(np.int32)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = model_fn(tf.constant(x), tf.constant(y), TRAIN)
    variables = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      losses = [session.run([spec.loss, spec.train_op])[0]
                for _ in range(steps)]
      return losses, session.run(variables)


@pytest.mark.parametrize("towers", [2, 3])
def test_the_tf1_tutorials_variables_train_like_one_device(towers):
  losses, values = _train_tutorial(_tutorial_model_fn, 1)
  # Zero weights: every logit is 0, so the first loss is ln 2.
  assert losses[0] == pytest.approx(np.log(2.0))
  got_losses, got_values = _train_tutorial(replicate.replicate_model_fn(
      _tutorial_model_fn, devices=cpus(towers)), towers)
  np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
  assert sorted(got_values) == sorted(values) == ["Variable", "Variable_1"]
  for name, value in values.items():
    assert np.abs(value).max() > 0.01  # it trained
    np.testing.assert_allclose(got_values[name], value, rtol=1e-5,
                               atol=1e-7)


def test_a_keras_layer_shared_by_every_tower_is_built_once(graph):
  # Built by tower 0 only; the tf.Variable after it still matches tower 0's.
  layer = tf.keras.layers.Dense(
      1, kernel_initializer=tf.keras.initializers.Constant(2.0))

  def model_fn(features, labels, mode):
    del labels
    offset = tf.Variable(5.0, name="offset")
    return tf.estimator.EstimatorSpec(
        mode, predictions=layer(features[:, None])[:, 0] + offset)

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      tf.range(ROWS, dtype=tf.float32), None, PREDICT)
  with tf.compat.v1.Session(config=session_config(3)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    # 2 * row + 0 (bias) + 5.
    np.testing.assert_array_equal(session.run(spec.predictions),
                                  2 * np.arange(ROWS) + 5)


def test_a_variable_whose_shape_follows_the_shard_is_refused(graph):
  def model_fn(features, labels, mode):
    del labels
    # Its shape is the tower's row count: 4 in tower 0, 3 in tower 1.
    scale = tf.Variable(np.ones(features.shape[0], np.float32))
    return tf.estimator.EstimatorSpec(mode, predictions=features * scale)

  with pytest.raises(ValueError, match=r"Tower 1 creates the variable "
                     r"'tower_1/Variable' with shape \(3,\).*tower 0's "
                     r"'Variable' has shape \(4,\)"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([ROWS]), None, PREDICT)


def test_variables_created_in_another_order_are_refused(graph):
  towers_built = []

  def model_fn(features, labels, mode):
    del labels
    towers_built.append(1)
    names = ["a", "b"] if len(towers_built) == 1 else ["b", "a"]
    first, second = [tf.Variable(1.0, name=name) for name in names]
    return tf.estimator.EstimatorSpec(mode,
                                      predictions=features * first * second)

  with pytest.raises(ValueError, match=r"Tower 1 creates the variable "
                     r"'tower_1/a', but tower 0 created no variable 'a' at "
                     r"that point \(tower 0's variables from there on: "
                     r"none\)"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([ROWS]), None, PREDICT)
