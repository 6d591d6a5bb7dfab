"""Checkpoints move between 1 and N towers and between variable strategies.

A run that switches how it trains halfway through (towers, strategy, or
wrapped vs unwrapped) ends with exactly the variables, optimizer slots
included, of a run that never switched.
"""

import shutil

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import checkpoint_values, session_config

_rng = np.random.RandomState(1)
X = _rng.rand(12, 4).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)) + 0.1


def _model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features, 3, tf.nn.relu, name="hidden")
  output = tf.compat.v1.layers.dense(hidden, 1, name="output")
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=output)
  loss = tf.compat.v1.losses.mean_squared_error(labels, output)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn():
  # 12 rows in batches of 5: 5, 5, 2 (uneven for 2 and 3 towers).
  return tf.data.Dataset.from_tensor_slices((X, Y)).batch(5)


def _estimator(model_dir, towers, strategy="parameter_server"):
  """towers=0: the unwrapped model_fn."""
  model_fn = _model_fn if towers == 0 else replicate.replicate_model_fn(
      _model_fn, variable_strategy=strategy)
  return tf.estimator.Estimator(
      model_fn, model_dir=model_dir,
      config=tf.estimator.RunConfig(session_config=session_config(
          max(towers, 1))))



@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """One step unwrapped: every run starts from the same variables."""
  model_dir = str(tmp_path_factory.mktemp("start"))
  _estimator(model_dir, 0).train(_input_fn, steps=1)
  return model_dir


def _two_phases(start, model_dir, first, second):
  shutil.copytree(start, model_dir, dirs_exist_ok=True)
  _estimator(model_dir, *first).train(_input_fn)
  _estimator(model_dir, *second).train(_input_fn)
  return checkpoint_values(model_dir)


@pytest.fixture(scope="module")
def never_switched(start, tmp_path_factory):
  return _two_phases(start, str(tmp_path_factory.mktemp("unwrapped")), (0,),
                     (0,))


@pytest.mark.parametrize("first, second", [
    ((2,), (3, "round_robin")),  # 2 towers -> 3 towers, other strategy
    ((3,), (0,)),  # 3 towers -> unwrapped
    ((0,), (2,)),  # unwrapped -> 2 towers
    ((3, "round_robin"), (1,)),  # -> one device
    ((2, "replicated"), (3, "parameter_server")),  # copies -> shared
    ((0,), (3, "replicated")),  # unwrapped -> copies, synced on restore
], ids=["2ps-3rr", "3ps-unwrapped", "unwrapped-2ps", "3rr-1", "2rep-3ps",
        "unwrapped-3rep"])
def test_switching_halfway_ends_where_not_switching_does(
    start, never_switched, tmp_path, first, second):
  switched = _two_phases(start, str(tmp_path), first, second)
  assert sorted(switched) == sorted(never_switched)  # Adam slots included
  assert switched["global_step"] == never_switched["global_step"] == 7
  for name, value in never_switched.items():
    np.testing.assert_allclose(switched[name], value, rtol=1e-5, atol=1e-7,
                               err_msg=name)
