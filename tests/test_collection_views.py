"""A model_fn that picks variables from a graph collection, as one device.

An `ExponentialMovingAverage` over the trainable variables and the batch
norm statistics chosen by name from `global_variables()`, grouped with the
train_op, as TPUEstimator-era image models (tensorflow/tpu's resnet and
efficientnet mains) write it. Tower i must see the collections as tower 0
saw them at the same point: were tower 0's average slots (named
`.../moving_variance/ExponentialMovingAverage`) in tower 1's
`global_variables()`, tower 1 would ask for an average of an average.
"""

import shutil

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import session_config

TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL

_rng = np.random.RandomState(3)
X = _rng.rand(11, 4).astype(np.float32)  # batches of 4, 4, 3: uneven
Y = (np.arange(11) % 3).astype(np.int32)


def _image_model_fn(features, labels, mode):
  training = mode == TRAIN
  hidden = tf.compat.v1.layers.dense(features["x"], 5, name="stem")
  hidden = tf.compat.v1.layers.batch_normalization(hidden, training=training,
                                                   name="bn")
  logits = tf.compat.v1.layers.dense(tf.nn.relu(hidden), 3, name="head")
  probabilities = tf.nn.softmax(logits)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "probabilities": probabilities})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, 1)),
        "confidence": tf.compat.v1.metrics.mean(
            tf.reduce_max(probabilities, 1))})
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  ema = tf.compat.v1.train.ExponentialMovingAverage(0.5)
  ema_vars = tf.compat.v1.trainable_variables() + [
      v for v in tf.compat.v1.global_variables()
      if "moving_mean" in v.name or "moving_variance" in v.name]
  with tf.control_dependencies([train_op]):
    train_op = tf.group(ema.apply(ema_vars))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input():
  return tf.data.Dataset.from_tensor_slices(({"x": X}, Y)).batch(4)


def _outcome(model_fn, model_dir, towers):
  estimator = tf.estimator.Estimator(model_fn, model_dir=model_dir, config=(
      tf.estimator.RunConfig(session_config=session_config(towers))))
  estimator.train(_input)
  metrics = estimator.evaluate(_input)
  predictions = np.array([p["probabilities"] for p in estimator.predict(
      lambda: tf.data.Dataset.from_tensor_slices({"x": X}).batch(4))])
  variables = {name: tf.train.load_variable(model_dir, name)
               for name, _ in tf.train.list_variables(model_dir)}
  return metrics, predictions, variables


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  start = str(tmp_path_factory.mktemp("start"))
  tf.estimator.Estimator(_image_model_fn, model_dir=start).train(
      _input, steps=1)
  unwrapped = str(tmp_path_factory.mktemp("unwrapped"))
  shutil.copytree(start, unwrapped, dirs_exist_ok=True)
  return start, _outcome(_image_model_fn, unwrapped, 1)


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy",
                         ["parameter_server", "round_robin", "replicated"])
def test_moving_averages_of_statistics_chosen_by_name_equal_one_device(
    one_device, towers, strategy, tmp_path):
  start, (metrics, predictions, variables) = one_device
  shutil.copytree(start, tmp_path, dirs_exist_ok=True)
  got_metrics, got_predictions, got_variables = _outcome(
      replicate.replicate_model_fn(_image_model_fn,
                                   variable_strategy=strategy),
      str(tmp_path), towers)
  assert sorted(got_variables) == sorted(variables)
  averages = [n for n in variables if n.endswith("ExponentialMovingAverage")]
  # stem, bn (gamma, beta, moving mean and variance), head: 8 averages.
  assert len(averages) == 8
  for name, value in variables.items():
    # atol: the stem's bias, ahead of the batch norm, has no gradient but
    # rounding's (1e-7).
    np.testing.assert_allclose(got_variables[name], value, rtol=1e-5,
                               atol=1e-5, err_msg=name)
  assert got_metrics["global_step"] == metrics["global_step"] == 4
  for key in ("loss", "accuracy", "confidence"):
    np.testing.assert_allclose(got_metrics[key], metrics[key], rtol=1e-5)
  np.testing.assert_allclose(got_predictions, predictions, rtol=1e-5,
                             atol=1e-6)
