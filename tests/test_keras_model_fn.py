"""A Keras legacy optimizer in one's own `model_fn`, through `get_updates`.

`TowerOptimizer(tf.keras.optimizers.Adam())` (a Keras v2 optimizer) is
refused, and a Keras legacy optimizer's `minimize` wants a callable loss in
graph mode, so docs/api.md gives the call that works with a loss tensor: the
one the TF 2 canned estimators make, `optimizer.iterations = global step`,
then `optimizer.get_updates(loss, params)[0]`. Here it trains on 2 towers
exactly like the unwrapped `model_fn` on one device: same batches (11 rows,
split 6 + 5), same initial values, every variable and slot after 3 steps.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import checkpoint_values, session_config

ROWS = 11
STEPS = 3
_RANDOM = np.random.RandomState(7)
X = _RANDOM.rand(ROWS, 3).astype(np.float32)
Y = (X.sum(axis=1) > 1.5).astype(np.int64)
HIDDEN = _RANDOM.randn(3, 4).astype(np.float32)
LOGITS = _RANDOM.randn(4, 2).astype(np.float32)


def input_fn():
  return tf.data.Dataset.from_tensor_slices((X, Y)).batch(ROWS).repeat()


def model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(
      features, 4, tf.nn.relu, kernel_initializer=tf.constant_initializer(
          HIDDEN))
  logits = tf.compat.v1.layers.dense(
      hidden, 2, kernel_initializer=tf.constant_initializer(LOGITS))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.keras.optimizers.legacy.Adam(0.05))
  # As the TF 2 canned estimators do: Keras counts steps in the global step,
  # and get_updates(loss, params) takes the loss tensor.
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  train_op = optimizer.get_updates(
      loss, tf.compat.v1.trainable_variables())[0]
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _trained(model_fn_to_train, model_dir, towers):
  estimator = tf.estimator.Estimator(
      model_fn_to_train, model_dir=str(model_dir),
      config=tf.estimator.RunConfig(session_config=session_config(towers)))
  estimator.train(input_fn, max_steps=STEPS)
  return checkpoint_values(str(model_dir))


@pytest.mark.parametrize("variable_strategy",
                         ["parameter_server", "replicated"])
def test_keras_legacy_get_updates_on_2_towers_trains_like_one_device(
    tmp_path, variable_strategy):
  unwrapped = _trained(model_fn, tmp_path / "one", 1)
  wrapped = _trained(replicate.replicate_model_fn(
      model_fn, variable_strategy=variable_strategy), tmp_path / "two", 2)

  assert unwrapped["global_step"] == STEPS
  # The kernels, biases, Adam's two slots of each and its hyperparameters
  # (no step counter of its own: its iterations are the global step).
  assert sorted(wrapped) == sorted(unwrapped)
  assert sorted(name for name in unwrapped
                if not name.startswith(("dense", "Adam/dense"))) == [
      "Adam/beta_1", "Adam/beta_2", "Adam/decay", "Adam/learning_rate",
      "global_step"]
  assert len(unwrapped) == 5 + 4 * 3
  for name, value in unwrapped.items():
    np.testing.assert_allclose(wrapped[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # Training moved every variable.
  assert not np.allclose(unwrapped["dense/kernel"], HIDDEN)


def test_a_keras_v2_optimizer_is_refused_naming_the_legacy_one():
  with pytest.raises(ValueError) as raised:
    replicate.TowerOptimizer(tf.keras.optimizers.Adam())
  assert "tf.keras.optimizers.legacy" in str(raised.value)
