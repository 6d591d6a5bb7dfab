"""Models written for TensorFlow 1 behaviour run wrapped like unwrapped.

`make test` runs this file, with part of the suite, a second time under
`tf.compat.v1.disable_v2_behavior()` (REPLICATE_TF1_BEHAVIOR=1, see
conftest.py). There a static dimension is a `Dimension` (unknown:
`Dimension(None)`), not an int or None, and variables are ref variables
unless a model asks for resource ones. In the ordinary run these tests check
the same numbers under TF 2 behaviour.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, IS_TF1_BEHAVIOR, PREDICT, TRAIN, cpus
from conftest import regression_spec, session_config

_ROWS = 7
_X = np.linspace(-1.0, 1.0, _ROWS * 2, dtype=np.float32).reshape(_ROWS, 2)
_Y = (_X @ np.array([[1.5], [-2.0]], np.float32) + 0.25).astype(np.float32)
_IDS = tf.compat.v1.SparseTensorValue(  # one or two ids per row, row 3 none
    indices=[[0, 0], [1, 0], [1, 1], [2, 0], [4, 0], [5, 0], [5, 1], [6, 0]],
    values=np.array([0, 1, 2, 3, 1, 0, 3, 2], np.int64), dense_shape=[_ROWS, 2])


def test_the_suite_runs_under_the_behaviour_it_was_asked_for():
  assert tf.compat.v1.executing_eagerly() is False or not IS_TF1_BEHAVIOR
  with tf.Graph().as_default():
    rows = tf.compat.v1.placeholder(tf.float32, [None, 2]).shape[0]
    variable = tf.compat.v1.get_variable("v", [])
  # TF 1 behaviour: a Dimension and a ref variable; TF 2: None and resource.
  assert isinstance(rows, tf.compat.v1.Dimension) == IS_TF1_BEHAVIOR
  assert (variable.op.type == "VariableV2") == IS_TF1_BEHAVIOR


def _model_fn(features, labels, mode):
  """A dense and a sparse-embedding input, moving averages, metrics."""
  table = tf.compat.v1.get_variable(
      "table", [4, 1], initializer=tf.compat.v1.constant_initializer(
          [0.5, -0.5, 0.25, 1.0]))
  # Row 3, with no ids, embeds as zeros.
  embedded = tf.compat.v1.nn.safe_embedding_lookup_sparse(
      table, features["ids"], combiner="sum")
  hidden = tf.compat.v1.layers.dense(
      features["x"], 3, tf.nn.tanh, name="hidden",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.6, 0.6, 6).reshape(2, 3)))
  predictions = tf.compat.v1.layers.dense(
      hidden, 1, name="out", kernel_initializer=tf.compat.v1.constant_initializer(
          0.4)) + embedded
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"y": predictions})
  return regression_spec(mode, labels, predictions,
                         tf.compat.v1.train.AdamOptimizer(0.1))


def _outcome(model_fn, is_static_shape):
  """TRAIN: 3 steps' losses and the variables; EVAL: loss, mae; PREDICT."""
  outcome = {}
  rows = _ROWS if is_static_shape else None
  for mode in (TRAIN, EVAL, PREDICT):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      x = tf.compat.v1.placeholder(tf.float32, [rows, 2])
      y = tf.compat.v1.placeholder(tf.float32, [rows, 1])
      ids = tf.compat.v1.sparse_placeholder(tf.int64, [rows, 2])
      spec = model_fn({"x": x, "ids": ids}, None if mode == PREDICT else y,
                      mode)
      feed = {x: _X, y: _Y, ids: _IDS}
      with tf.compat.v1.Session(config=session_config(3)) as session:
        session.run([tf.compat.v1.global_variables_initializer(),
                     tf.compat.v1.local_variables_initializer()])
        if mode == TRAIN:
          losses = [session.run([spec.loss, spec.train_op], feed)[0]
                    for _ in range(3)]
          outcome[mode] = losses + session.run(
              tf.compat.v1.global_variables())
        elif mode == EVAL:
          session.run(spec.eval_metric_ops["mae"][1], feed)
          outcome[mode] = session.run(
              [spec.loss, spec.eval_metric_ops["mae"][0]], feed)
        else:
          outcome[mode] = session.run(spec.predictions["y"], feed)
  return outcome


@pytest.mark.parametrize("is_static_shape", [True, False],
                         ids=["static", "unknown"])
@pytest.mark.parametrize("towers", [2, 3])
def test_seven_rows_train_evaluate_and_predict_like_unwrapped(
    towers, is_static_shape):
  expected = _outcome(_model_fn, is_static_shape)
  got = _outcome(replicate.replicate_model_fn(_model_fn, devices=cpus(towers)),
                 is_static_shape)
  for mode in (TRAIN, EVAL, PREDICT):
    assert len(tf.nest.flatten(got[mode])) == len(tf.nest.flatten(
        expected[mode]))
    for got_value, expected_value in zip(tf.nest.flatten(got[mode]),
                                         tf.nest.flatten(expected[mode])):
      np.testing.assert_allclose(got_value, expected_value, rtol=1e-5,
                                 atol=1e-6, err_msg=mode)
  assert got[PREDICT].shape == (_ROWS, 1)
