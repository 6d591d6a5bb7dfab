"""The core promise: N towers train like one device on the same batches.

Every model here starts from constant initial values, so the unwrapped
`model_fn` on one device and the wrapped one on 1, 2 or 3 towers start alike
without a shared checkpoint; after several steps on the same global batches
every variable (optimizer slots and accumulators included) and every step's
loss must agree to 1e-5 relative.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
STEPS = 4
_rng = np.random.RandomState(7)


def _batches(rows):
  """STEPS batches of `rows` rows: dense x, embedding ids (repeats), labels."""
  return [{
      "x": _rng.rand(rows, 4).astype(np.float32),
      "ids": _rng.randint(0, 5, size=(rows, 3)).astype(np.int64),
      "y": _rng.rand(rows, 1).astype(np.float32),
  } for _ in range(STEPS)]


def _make_model_fn(reduction, optimizer_name, rows):
  # A summed loss grows with the batch: scale the step so training stays in
  # a regime where float32 rounding, not divergence, bounds the difference.
  learning_rate = 0.1 / rows if reduction == Reduction.SUM else 0.1

  def model_fn(features, labels, mode):
    table = tf.compat.v1.get_variable(
        "embedding", [5, 2],
        initializer=tf.compat.v1.constant_initializer(
            np.linspace(-1.0, 1.0, 10).reshape(5, 2)))
    # Gather gives IndexedSlices gradients, with repeated ids in a batch.
    embedded = tf.reduce_sum(tf.nn.embedding_lookup(table, features["ids"]),
                             axis=1)
    inputs = tf.concat([features["x"], embedded], axis=1)
    hidden = tf.compat.v1.layers.dense(
        inputs, 3, tf.nn.tanh, name="hidden",
        kernel_initializer=tf.compat.v1.constant_initializer(
            np.linspace(-0.5, 0.5, 18).reshape(6, 3)))
    output = tf.compat.v1.layers.dense(
        hidden, 1, name="output",
        kernel_initializer=tf.compat.v1.constant_initializer(0.3))
    loss = tf.compat.v1.losses.mean_squared_error(labels, output,
                                                  reduction=reduction)
    optimizer = (tf.compat.v1.train.AdamOptimizer(0.1)
                 if optimizer_name == "adam" else
                 tf.compat.v1.train.GradientDescentOptimizer(learning_rate))
    train_op = replicate.TowerOptimizer(optimizer).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _train(model_fn, batches):
  """Runs STEPS steps; returns the losses and every global variable."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    ids = tf.compat.v1.placeholder(tf.int64, [None, 3])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = model_fn({"x": x, "ids": ids}, y, TRAIN)
    variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      losses = [session.run([spec.loss, spec.train_op],
                            {x: b["x"], ids: b["ids"], y: b["y"]})[0]
                for b in batches]
      values = session.run({v.op.name: v for v in variables})
  return losses, values


def _assert_same_training(got, expected):
  (got_losses, got_values), (losses, values) = got, expected
  np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
  assert sorted(got_values) == sorted(values)  # names included
  assert got_values["global_step"] == values["global_step"] == STEPS
  for name, value in values.items():
    assert np.all(np.isfinite(got_values[name])), name
    np.testing.assert_allclose(got_values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("rows", [12, 7, 2], ids=["even", "uneven", "small"])
@pytest.mark.parametrize("optimizer_name", ["adam", "sgd"])
@pytest.mark.parametrize("reduction", [
    Reduction.SUM, Reduction.MEAN, Reduction.SUM_BY_NONZERO_WEIGHTS
])
def test_towers_train_like_one_device(reduction, optimizer_name, rows):
  batches = _batches(rows)
  model_fn = _make_model_fn(reduction, optimizer_name, rows)
  expected = _train(model_fn, batches)
  for towers in (1, 2, 3):
    for strategy in ("parameter_server", "round_robin"):
      wrapped = replicate.replicate_model_fn(
          model_fn, loss_reduction=reduction, devices=cpus(towers),
          variable_strategy=strategy)
      _assert_same_training(_train(wrapped, batches), expected)


def _sparse_model_fn(features, labels, mode):
  table = tf.compat.v1.get_variable(
      "table", [6, 2],
      initializer=tf.compat.v1.constant_initializer(
          np.linspace(0.0, 1.0, 12).reshape(6, 2)))
  embedded = tf.compat.v1.nn.safe_embedding_lookup_sparse(
      table, features["ids"], combiner="sqrtn")
  output = tf.compat.v1.layers.dense(
      tf.reshape(embedded, [-1, 2]), 1, name="output",
      kernel_initializer=tf.compat.v1.constant_initializer(0.5))
  loss = tf.compat.v1.losses.mean_squared_error(labels, output)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.2)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _sparse_batch(rows):
  """Row r holds r % 3 ids (some rows empty), as a SparseTensorValue."""
  indices = [[r, k] for r in range(rows) for k in range(r % 3)]
  values = _rng.randint(0, 6, size=len(indices)).astype(np.int64)
  return (tf.compat.v1.SparseTensorValue(
      np.array(indices, np.int64).reshape(-1, 2), values, [rows, 2]),
          _rng.rand(rows, 1).astype(np.float32))


def _train_sparse(model_fn, batches):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    ids = tf.compat.v1.sparse_placeholder(tf.int64)
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = model_fn({"ids": ids}, y, TRAIN)
    variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      losses = [session.run([spec.loss, spec.train_op],
                            {ids: sparse, y: labels})[0]
                for sparse, labels in batches]
      values = session.run({v.op.name: v for v in variables})
  return losses, values


def test_sparse_tensor_features_train_like_one_device():
  # Batches of 7 (uneven for 2 and 3 towers) and 2 (smaller than 3 towers).
  batches = [_sparse_batch(rows) for rows in (7, 2, 7, 5)]
  expected = _train_sparse(_sparse_model_fn, batches)
  for towers in (2, 3):
    wrapped = replicate.replicate_model_fn(_sparse_model_fn,
                                           devices=cpus(towers))
    _assert_same_training(_train_sparse(wrapped, batches), expected)
