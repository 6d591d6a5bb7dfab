"""Statistics and counters a train_op keeps, wrapped against unwrapped.

Batch renorm's extra statistics, an ExponentialMovingAverage of the loss
(also of a padded token-mean loss, by the loss's weights),
an integer counter in UPDATE_OPS, rows counted from a folded `ones_like`,
Keras batch norm updates grouped with the train_op, and a replicated
sparse update that must leave the rows the batch did not look up alone.
Expected numbers come from the unwrapped model_fn on the same batches; the
"observed" values in the comments are what the wrapper did before.
"""

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import TRAIN

UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS
_INIT = tf.compat.v1.constant_initializer(0.3)


def _train(model_fn, batches, towers=None, strategy="parameter_server",
           static=False):
  """Runs one train step per batch; returns {variable op name: value}."""
  wrap_kwargs = {} if towers is None else {"variable_strategy": strategy}
  return harness.train(model_fn, batches, towers, known_rows=static,
                       step_fetches=lambda spec: {}, session_towers=3,
                       **wrap_kwargs).variables


def _rows(n=7):
  rng = np.random.RandomState(0)
  return {"x": rng.rand(n, 3).astype(np.float32),
          "y": rng.rand(n, 1).astype(np.float32)}


def _images(n=7):
  rng = np.random.RandomState(0)
  return {"x": rng.rand(n, 4, 4, 2).astype(np.float32) * 3,
          "y": rng.rand(n, 1).astype(np.float32)}


def _regression(features, labels, optimizer, extra=lambda loss, labels: []):
  predictions = tf.compat.v1.layers.dense(
      tf.reshape(features, [-1, int(np.prod(features.shape[1:]))]), 1,
      kernel_initializer=_INIT)
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
    step = replicate.TowerOptimizer(optimizer).minimize(
        loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      TRAIN, loss=loss, train_op=tf.group(step, *extra(loss, labels)))


CONFIGS = [(2, "parameter_server"), (3, "replicated")]


@pytest.mark.parametrize("towers, strategy", CONFIGS)
def test_batch_renorm_statistics_move_once(towers, strategy):
  # renorm_momentum 0.5 from 0: renorm_mean = 0.5 * whole-batch mean
  # = [0.7609, 0.7381], as moving_mean. Observed: N times that
  # ([1.515, 1.484] with 2 towers, [2.2945, 2.2356] with 3): the renorm
  # writes sit behind the UPDATE_OPS writes, which train_op._update_writes
  # starts its walk at and never walks past, so each tower applies its own.
  def model_fn(features, labels, mode):
    del mode
    normed = tf.compat.v1.layers.batch_normalization(
        features["x"], training=True, renorm=True, momentum=0.5,
        renorm_momentum=0.5)
    return _regression(normed, labels,
                       tf.compat.v1.train.GradientDescentOptimizer(0.01))

  expected = _train(model_fn, [_images()])
  got = _train(model_fn, [_images()], towers, strategy)
  np.testing.assert_allclose(expected["batch_normalization/renorm_mean"],
                             [0.7609, 0.7381], atol=1e-4)
  np.testing.assert_allclose(got["batch_normalization/moving_mean"],
                             expected["batch_normalization/moving_mean"],
                             atol=1e-4)
  np.testing.assert_allclose(got["batch_normalization/renorm_mean"],
                             expected["batch_normalization/renorm_mean"],
                             atol=1e-4)


@pytest.mark.parametrize("zero_debias", [False, True])
def test_moving_average_of_the_loss_builds(zero_debias):
  # The cifar10-tutorial pattern: ema.apply([loss]) grouped with the step.
  # Unwrapped it builds and trains; wrapped, tower 1 raises
  # "Variable tower_1/mean_squared_error/value/ExponentialMovingAverage/
  # does not exist" (the EMA's slot is a get_variable under reuse=True).
  def model_fn(features, labels, mode):
    del mode
    ema = tf.train.ExponentialMovingAverage(0.5, zero_debias=zero_debias)
    return _regression(features["x"], labels,
                       tf.compat.v1.train.GradientDescentOptimizer(0.1),
                       extra=lambda loss, labels: [ema.apply([loss])])

  expected = _train(model_fn, [_rows()])
  got = _train(model_fn, [_rows()], 2)
  np.testing.assert_allclose(got["dense/kernel"], expected["dense/kernel"],
                             rtol=1e-5)


@pytest.mark.parametrize("towers, strategy", CONFIGS)
def test_integer_counter_in_update_ops_counts(towers, strategy):
  # An int64 counter.assign_add(1) in UPDATE_OPS, 3 steps: unwrapped 3.
  # Observed 0: combine_update_ops casts the share n_i / n (4/7, 3/7) to
  # int64, which is 0, so every term of the combined value is 0.
  def model_fn(features, labels, mode):
    del mode
    counter = tf.compat.v1.get_variable(
        "updates_seen", [], tf.int64, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
    tf.compat.v1.add_to_collection(UPDATE_OPS, counter.assign_add(1))
    return _regression(features["x"], labels,
                       tf.compat.v1.train.GradientDescentOptimizer(0.1))

  assert _train(model_fn, [_rows()] * 3)["updates_seen"] == 3
  assert _train(model_fn, [_rows()] * 3, towers, strategy)["updates_seen"] == 3


@pytest.mark.parametrize("towers, strategy", CONFIGS)
def test_rows_counted_with_ones_like_on_a_static_batch(towers, strategy):
  # seen.assign_add(reduce_sum(ones_like(labels))): 7 rows -> 7.
  # With a static batch TF folds ones_like to a Const not named Size/Shape,
  # so train_op._reads_rows thinks towers 1..N-1 do not read their rows and
  # drops their count: observed 4.0 (2 towers) and 3.0 (3 towers).
  def model_fn(features, labels, mode):
    del mode
    seen = tf.compat.v1.get_variable(
        "seen", [], tf.float32, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
    return _regression(
        features["x"], labels,
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        extra=lambda loss, labels: [
            seen.assign_add(tf.reduce_sum(tf.ones_like(labels)))])

  assert _train(model_fn, [_rows()], static=True)["seen"] == 7.0
  assert _train(model_fn, [_rows()], towers, strategy,
                static=True)["seen"] == 7.0


def test_replicated_sparse_update_leaves_unseen_rows_alone():
  # Momentum(0.1, 0.9) on a 5x2 embedding. Step 1 looks up row 4, step 2
  # does not: unwrapped, the sparse update leaves row 4 at
  # 0.7778 + 0.014 = [0.7918, 1.0140] after step 2. Replicated, the small
  # table's gradient is all-reduced dense and connected to tower 0's
  # IndexedSlices stand-in as slices of every row, so row 4's momentum
  # moves it again: observed [0.8044, 1.0266] (0.014 + 0.9 * 0.014).
  def model_fn(features, labels, mode):
    del mode
    table = tf.compat.v1.get_variable(
        "emb", [5, 2], initializer=tf.compat.v1.constant_initializer(
            np.linspace(-1, 1, 10).reshape(5, 2)))
    embedded = tf.reduce_sum(
        tf.nn.embedding_lookup(table, features["ids"]), 1)
    return _regression(embedded, labels,
                       tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))

  ones = np.ones((4, 1), np.float32)
  batches = [{"ids": np.array([[4], [4], [0], [1]], np.int64), "y": ones},
             {"ids": np.array([[0], [1], [2], [3]], np.int64), "y": ones}]
  expected = _train(model_fn, batches)
  np.testing.assert_allclose(expected["emb"][4], [0.7918, 1.0140], atol=1e-4)
  assert np.allclose(_train(model_fn, batches, 2, "parameter_server")["emb"],
                     expected["emb"], atol=1e-6)
  np.testing.assert_allclose(_train(model_fn, batches, 2, "replicated")["emb"],
                             expected["emb"], atol=1e-6)


@pytest.mark.parametrize("towers, strategy", CONFIGS)
def test_keras_batch_norm_updates_grouped_into_train_op(towers, strategy):
  # tf.keras BatchNormalization in a v1 model_fn adds nothing to UPDATE_OPS;
  # its updates are grouped into the train_op, as Keras' docs suggest
  # (layer.updates). Unwrapped, momentum 0.5 moves moving_variance from 1 to
  # [0.5194, 0.5467, 0.5422]. Wrapped, each tower's update runs in full
  # (they read the tower's rows): observed [0.2734, 0.3081, 0.3034] with 2
  # towers and a negative variance [-0.4347, -0.3889, -0.4582] with 3.
  def model_fn(features, labels, mode):
    del mode
    layer = tf.keras.layers.BatchNormalization(momentum=0.5)
    normed = layer(features["x"], training=True)
    return _regression(normed, labels,
                       tf.compat.v1.train.GradientDescentOptimizer(0.0),
                       extra=lambda loss, labels: layer.updates)

  expected = _train(model_fn, [_rows()])
  got = _train(model_fn, [_rows()], towers, strategy)
  np.testing.assert_allclose(expected["batch_normalization/moving_variance"],
                             [0.5194, 0.5467, 0.5422], atol=1e-4)
  assert np.all(got["batch_normalization/moving_variance"] > 0)
  np.testing.assert_allclose(got["batch_normalization/moving_mean"],
                             expected["batch_normalization/moving_mean"],
                             atol=1e-4)


def _padded(seed, n=7):
  """7 rows, some of weight 0: tower 1 of 2 (rows 4-6) is all padding in
  the second batch, so its token mean is 0 / 0."""
  rng = np.random.RandomState(seed)
  weights = (rng.rand(n) > 0.4).astype(np.float32)
  weights[:3] = [0, 0, 1]
  return {"x": rng.rand(n, 3).astype(np.float32), "w": weights,
          "y": rng.rand(n, 1).astype(np.float32)}


def _token_mean_with_average(stated, zero_debias):
  def model_fn(features, labels, mode):
    del mode
    predictions = tf.compat.v1.layers.dense(features["x"], 1,
                                            kernel_initializer=_INIT)
    weights = features["w"]
    errors = tf.reduce_sum(tf.square(predictions - labels), 1)
    if stated:
      loss = tf.reduce_sum(errors * weights) / tf.maximum(
          tf.reduce_sum(weights), 1.0)
      replicate.loss_denominator(tf.reduce_sum(weights))
    else:
      loss = tf.reduce_sum(errors * weights) / tf.reduce_sum(weights)
    average = tf.train.ExponentialMovingAverage(
        0.5, zero_debias=zero_debias).apply([loss])
    with tf.control_dependencies([average]):
      step = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
              loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(TRAIN, loss=loss, train_op=step)
  return model_fn


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("stated", [False, True])
@pytest.mark.parametrize("zero_debias", [False, True])
def test_moving_average_of_a_token_mean_loss_uses_the_loss_weights(
    towers, stated, zero_debias):
  # A moving average of a padded token-mean loss (reduce_sum(l * w) /
  # reduce_sum(w), or divided by max(reduce_sum(w), 1) and stated with
  # replicate.loss_denominator), 3 steps: unwrapped the average is 0.103312
  # (0.118071 with zero_debias). Observed on main f27fa8c, combined by the
  # row shares n_i / n: NaN read from the graph (tower 1 of 2 is all
  # padding in the second batch: its 0 / 0 times its share); stated, 0.10181
  # (2 towers) and 0.05334 (3 towers, 48 % off); with zero_debias 0.11636
  # and 0.06096. The kernels were equal: only the statistic was off.
  batches = [_padded(seed) for seed in range(3)]
  model_fn = _token_mean_with_average(stated, zero_debias)
  expected = _train(model_fn, batches)
  got = _train(model_fn, batches, towers)
  averages = [name for name in expected
              if name.endswith("ExponentialMovingAverage")]
  assert averages
  np.testing.assert_allclose(expected[averages[0]],
                             0.118071 if zero_debias else 0.103312,
                             rtol=1e-5)
  for name in averages + ["dense/kernel"]:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)


def test_a_statistic_of_the_loss_and_of_the_rows_is_refused():
  # The loss's part is made the whole batch's; what else the value reads
  # from the tower's rows could not be told: refused, naming the write.
  def model_fn(features, labels, mode):
    del mode
    ema = tf.train.ExponentialMovingAverage(0.5, zero_debias=False)
    return _regression(features["x"], labels,
                       tf.compat.v1.train.GradientDescentOptimizer(0.1),
                       extra=lambda loss, labels: [ema.apply(
                           [loss * tf.reduce_mean(labels)])])

  with pytest.raises(ValueError, match=r"statistic write .*of 'mul.*Exp.*"
                     r"computed from its loss .*mean_squared_error.*separate "
                     r"moving average"):
    _train(model_fn, [_rows()], 2)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("stated", [False, True])
def test_moving_average_of_a_token_mean_with_a_tower_without_rows(
    static, stated):
  # 2 rows on 3 towers: a row of weight 1, a row of weight 0 (tower 1's
  # token mean is 0 / 0), and a tower on a stand-in row. Observed on main
  # f27fa8c: NaN read from the graph, 0.02372 stated (one device 0.04744).
  batches = []
  for seed in range(3):
    batch = {key: value[-2:] for key, value in _padded(seed).items()}
    batch["w"] = np.array([1.0, 0.0], np.float32)
    batches.append(batch)
  model_fn = _token_mean_with_average(stated, zero_debias=True)
  expected = _train(model_fn, batches, static=static)
  got = _train(model_fn, batches, 3, static=static)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
