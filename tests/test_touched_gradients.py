"""Gradients the model_fn touches are the whole batch's (issue 30, item 3).

API.md, "Batch-level values are the whole batch's": code between
`compute_gradients` / `tf.gradients` / `GradientTape` and `apply_gradients`
(clipping by global norm, scaling, logging the norm) sees the sum over
towers, so `tf.clip_by_global_norm` there clips as on one device. Each test
trains a small MLP (with an embedding lookup, whose gradient is
`IndexedSlices`) unwrapped on one device and wrapped on 2 and 3 towers, from
the same initial values on the same batches, with the clip active; every
variable and the logged norm must be one device's.
"""

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate

PS, REPLICATED = "parameter_server", "replicated"
CLIP = 0.05  # the batch's global norm is 1 to 2: the clip is active
STEPS = 3


def _batches(rows, steps=STEPS):
  rng = np.random.RandomState(0)
  return [(rng.rand(rows, 3).astype(np.float32) * 2 - 1,
           rng.randint(0, 3, size=rows).astype(np.int32))
          for _ in range(steps)]


class _AdamW(tf.compat.v1.train.Optimizer):
  """A custom v1 optimizer as BERT writes one: its own apply_gradients."""

  def __init__(self, learning_rate):
    super().__init__(False, "AdamW")
    self.learning_rate = learning_rate

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    assignments = []
    for grad, param in grads_and_vars:
      if grad is None or param is None:
        continue
      name = param.op.name
      m = tf.compat.v1.get_variable(
          name + "/adam_m", param.shape, tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      v = tf.compat.v1.get_variable(
          name + "/adam_v", param.shape, tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      grad = tf.convert_to_tensor(grad)
      next_m = 0.9 * m + 0.1 * grad
      next_v = 0.999 * v + 0.001 * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + 1e-6) + 0.01 * param
      assignments += [param.assign(param - self.learning_rate * update),
                      m.assign(next_m), v.assign(next_v)]
    if global_step is not None:
      assignments.append(global_step.assign_add(1))
    return tf.group(*assignments, name=name)


def _optimizer(kind):
  if kind == "sgd":
    return tf.compat.v1.train.GradientDescentOptimizer(1.0)
  if kind == "adam":
    return tf.compat.v1.train.AdamOptimizer(0.1)
  return _AdamW(0.1)


def _halved(grad):
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * 0.5, grad.indices, grad.dense_shape)
  return grad * 0.5


def _model_fn(way, kind, norms, touch="clip", regularized=False):
  """`way`: where the gradients come from; `touch`: what changes them;
  `regularized`: an L2 regularizer on the hidden kernel, in the loss."""

  def model_fn(features, labels, mode):
    x = features["x"]
    variables = []

    def variable(name, shape, start, stop):
      # A replicated tower gets its own copy from get_variable.
      variables.append(tf.compat.v1.get_variable(
          name, shape, initializer=tf.compat.v1.constant_initializer(
              np.linspace(start, stop, np.prod(shape)).reshape(shape)),
          regularizer=tf.keras.regularizers.l2(0.5)
          if regularized and name == "hidden" else None))
      return variables[-1]

    def loss_of():
      table = variable("table", [5, 8], -0.5, 0.5)
      ids = tf.cast(tf.floor((x[:, 0] + 1.0) * 2.4), tf.int32)
      hidden = tf.nn.relu(tf.matmul(x, variable("hidden", [3, 8], -1, 1)) +
                          variable("hidden_bias", [8], 0, 0.1) +
                          tf.gather(table, ids))
      logits = (tf.matmul(hidden, variable("logits", [8, 3], 1, -1)) +
                variable("logits_bias", [3], 0, 0.1))
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      if regularized:
        loss += tf.compat.v1.losses.get_regularization_loss()
      return loss

    optimizer = replicate.TowerOptimizer(_optimizer(kind))
    if way == "tape":
      with tf.GradientTape() as tape:
        loss = loss_of()
    else:
      loss = loss_of()
    if way == "compute":
      grads, variables = zip(*optimizer.compute_gradients(loss, variables))
    elif way == "tape":
      grads = tape.gradient(loss, variables)
    else:
      grads = tf.gradients(loss, variables)
    if touch == "scale":
      norm = tf.linalg.global_norm(grads)
      grads = [_halved(g) for g in grads]
    else:
      grads, norm = tf.clip_by_global_norm(grads, CLIP)
    norms.append(norm)
    train_op = optimizer.apply_gradients(
        zip(grads, variables), tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _train(way, kind, rows=7, towers=None, touch="clip", regularized=False,
           **wrap_kwargs):
  """({variable: value}, the norm tower 0 logged at each step)."""
  norms = []
  run = harness.train(_model_fn(way, kind, norms, touch, regularized),
                      _batches(rows),
                      towers, step_fetches=lambda spec: {"norm": norms[0]},
                      **wrap_kwargs)
  return run.variables, run.per_step("norm")


def _assert_one_device(way, kind, towers, rows=7, touch="clip",
                       regularized=False, **wrap_kwargs):
  expected, expected_norms = _train(way, kind, rows, touch=touch,
                                    regularized=regularized)
  assert min(expected_norms) > 4 * CLIP  # the clip is active
  values, norms = _train(way, kind, rows, towers, touch, regularized,
                         **wrap_kwargs)
  np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
  assert sorted(values) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("way", ["compute", "gradients"])
def test_clip_by_global_norm_clips_the_batch(way, towers, strategy):
  _assert_one_device(way, "sgd", towers, variable_strategy=strategy)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("way", ["compute", "gradients"])
def test_a_regularized_loss_clips_like_one_device(way, strategy):
  # The regularization counts once in the batch's gradient. With
  # "replicated", tf.gradients reaches only the tower's copies: each tower
  # sees its copies' regularization (refused before, naming the wrong cause;
  # counted once in tower 0 it would be tower 0's share of it).
  _assert_one_device(way, "sgd", 3, regularized=True,
                     variable_strategy=strategy)


@pytest.mark.parametrize("towers", [2, 3])
def test_clip_after_a_gradient_tape(towers):
  # Not "replicated": a tape watches trainable variables only, and a
  # tower's copies are not in the trainable collection.
  _assert_one_device("tape", "sgd", towers)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("way", ["compute", "gradients"])
def test_clip_with_adam_and_a_custom_optimizer(way, kind):
  # BERT's way: tf.gradients, clip_by_global_norm, a custom v1 Optimizer.
  _assert_one_device(way, kind, 3)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("way", ["compute", "gradients"])
def test_a_tower_without_rows(way, strategy):
  _assert_one_device(way, "sgd", 3, rows=2, variable_strategy=strategy)


@pytest.mark.parametrize("way", ["compute", "gradients", "tape"])
def test_a_logged_norm_and_a_scale_are_the_batchs(way):
  # Logs tf.linalg.global_norm of the gradients, then halves them.
  _assert_one_device(way, "adam", 2, touch="scale")


def _two_calls_model_fn(features, labels, mode):
  # Two optimizers, each clipping its own part of the model, and an
  # accumulator of the first part's clipped gradients (state written from
  # a whole-batch value: once).
  x = features["x"]
  first = tf.compat.v1.get_variable(
      "first", [3, 4], initializer=tf.compat.v1.constant_initializer(
          np.linspace(-1, 1, 12).reshape(3, 4)))
  second = tf.compat.v1.get_variable(
      "second", [4, 3], initializer=tf.compat.v1.constant_initializer(
          np.linspace(1, -1, 12).reshape(4, 3)))
  logits = tf.matmul(tf.nn.tanh(tf.matmul(x, first)), second)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  accumulator = tf.compat.v1.get_variable(
      "accumulator", [3, 4], trainable=False,
      initializer=tf.compat.v1.zeros_initializer())
  ops = []
  for variables, rate in (([first], 1.0), ([second], 0.5)):
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(rate))
    grads, variables = zip(*optimizer.compute_gradients(loss, variables))
    grads, _ = tf.clip_by_global_norm(grads, CLIP)
    if rate == 1.0:
      ops.append(accumulator.assign_add(grads[0]))
    ops.append(optimizer.apply_gradients(zip(grads, variables)))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(*ops))


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
def test_two_optimizers_and_an_accumulator_of_clipped_gradients(strategy):
  expected = _train_model_fn(_two_calls_model_fn)
  values = _train_model_fn(_two_calls_model_fn, towers=3,
                           variable_strategy=strategy)
  assert sorted(values) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _train_model_fn(model_fn, towers=None, **wrap_kwargs):
  return harness.train(model_fn, _batches(7), towers,
                       step_fetches=lambda spec: {}, **wrap_kwargs).variables


def test_a_gradient_of_whole_batch_and_tower_values_is_refused():
  def model_fn(features, labels, mode):
    kernel = tf.compat.v1.get_variable("kernel", [3, 3])
    logits = tf.matmul(features["x"], kernel)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0))
    (grad, variable), = optimizer.compute_gradients(loss, [kernel])
    # Scaled by a value of the tower's rows: neither the batch's nor the
    # tower's gradient.
    grad *= tf.reduce_mean(features["x"] ** 2)
    train_op = optimizer.apply_gradients([(grad, variable)])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match=(
      r"Tower 0's gradient for 'kernel' passed to apply_gradients is "
      r"computed both from the whole batch's gradients .* and from the "
      r"tower's own rows .* Fix: compute the gradients of the total loss in "
      r"one compute_gradients call")):
    _train_model_fn(model_fn, towers=2)


def _second_loss_model_fn(features, labels, mode):
  kernel = tf.compat.v1.get_variable(
      "kernel", [3, 3], initializer=tf.compat.v1.constant_initializer(
          np.linspace(-1, 1, 9).reshape(3, 3)))
  logits = tf.matmul(features["x"], kernel)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(1.0))
  (grad, variable), = optimizer.compute_gradients(loss, [kernel])
  # A second loss's gradient from tf.gradients, added: the batch's too.
  grad += tf.gradients(tf.reduce_mean(logits ** 2), [kernel])[0]
  grad, _ = tf.clip_by_global_norm([grad], CLIP)
  train_op = optimizer.apply_gradients([(grad[0], variable)])
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_a_second_losss_gradient_added_to_compute_gradients_ones():
  expected = _train_model_fn(_second_loss_model_fn)
  values = _train_model_fn(_second_loss_model_fn, towers=3)
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
