"""Properties over random batch sizes (0..64) and tower counts (1..6).

Hypothesis draws the cases; `derandomize=True` keeps CI reproducible.
"""

import numpy as np
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import replicate
from conftest import TRAIN, cpus, session_config
from replicate.shard import sharding

_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)

batch_sizes = st.integers(min_value=0, max_value=64)
tower_counts = st.integers(min_value=1, max_value=6)


def _real_rows(parts, sizes):
  """Each shard's real rows (a tower without rows stands in one)."""
  return [part[:size] for part, size in zip(parts, sizes)]


@_SETTINGS
@given(batch_sizes, tower_counts, st.booleans())
def test_dense_shards_put_back_are_the_batch(rows, towers, dynamic):
  values = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
  with tf.Graph().as_default():
    x = (tf.compat.v1.placeholder(tf.float32, [None, 2]) if dynamic else
         tf.constant(values))
    shards = sharding.split_batch(x, None, towers)
    with tf.compat.v1.Session() as session:
      parts, sizes = session.run(
          (shards.features, tf.convert_to_tensor(shards.sizes)),
          {x: values} if dynamic else None)
  assert sizes.sum() == rows
  np.testing.assert_array_equal(
      np.concatenate(_real_rows(parts, sizes)), values)


@_SETTINGS
@given(batch_sizes, tower_counts, st.integers(0, 2**31 - 1))
def test_sparse_shards_put_back_are_the_batch(rows, towers, seed):
  rng = np.random.RandomState(seed)
  dense = rng.randint(0, 3, size=(rows, 4)) * rng.randint(1, 9, (rows, 4))
  with tf.Graph().as_default():
    sparse = tf.sparse.from_dense(tf.constant(dense, tf.int64))
    shards = sharding.split_batch({"ids": sparse}, None, towers)
    with tf.compat.v1.Session() as session:
      parts, sizes = session.run(
          ([tf.sparse.to_dense(f["ids"]) for f in shards.features],
           tf.convert_to_tensor(shards.sizes)))
  np.testing.assert_array_equal(
      np.concatenate(_real_rows(parts, sizes)).reshape(rows, 4), dense)


@_SETTINGS
@given(batch_sizes, tower_counts)
def test_weights_sum_to_one(rows, towers):
  sizes = sharding.shard_sizes(rows, towers)
  weights = sharding.shard_shares(sizes, rows)
  assert abs(sum(weights) - 1.0) < 1e-9
  # A tower without rows weighs 0, except tower 0 of a batch known to be
  # empty, which stands for that batch as the unwrapped model_fn would.
  assert all(w == 0.0 for index, (w, n) in enumerate(zip(weights, sizes))
             if n == 0 and (rows or index))
  assert max(sizes) - min(sizes) <= 1  # as even as rows allow


def _model_fn(features, labels, mode):
  w = tf.compat.v1.get_variable(
      "w", [2, 1], initializer=tf.compat.v1.constant_initializer([[0.5],
                                                                 [-1.0]]))
  loss = tf.compat.v1.losses.mean_squared_error(labels, features @ w)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _one_step(model_fn, x, y):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    features = tf.compat.v1.placeholder(tf.float32, [None, 2])
    labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = model_fn(features, labels, TRAIN)
    with tf.compat.v1.Session(config=session_config(6)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      loss, _ = session.run([spec.loss, spec.train_op],
                            {features: x, labels: y})
      return loss, session.run(tf.compat.v1.trainable_variables()[0])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.integers(min_value=1, max_value=64), tower_counts)
def test_one_step_on_towers_equals_one_on_a_single_device(rows, towers):
  rng = np.random.RandomState(rows)
  x = rng.rand(rows, 2).astype(np.float32)
  y = rng.rand(rows, 1).astype(np.float32)
  single = _one_step(_model_fn, x, y)
  replicated = _one_step(
      replicate.replicate_model_fn(_model_fn, devices=cpus(towers)), x, y)
  np.testing.assert_allclose(replicated[0], single[0], rtol=1e-5)
  np.testing.assert_allclose(replicated[1], single[1], rtol=1e-5)
