"""One step is one step: ordinary model code, wrapped against unwrapped.

Each test is a pattern real `model_fn`s use every day (an
`ExponentialMovingAverage` after the step, a step counter grouped with the
update, batch norm through `UPDATE_OPS`, regularizers, weighted and masked
losses, global-norm clipping), trained on the same batches unwrapped on one
device and wrapped on 2 and 3 towers, with batches that do not divide
evenly. Every variable must end where the unwrapped run ends, to 1e-5.
"""

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
PS, REPLICATED = "parameter_server", "replicated"
ROWS = 7  # 4 + 3 on 2 towers, 3 + 2 + 2 on 3
STEPS = 3


def _batches(rows=ROWS, steps=STEPS, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.rand(rows, 3).astype(np.float32) * 2 - 1,
           rng.randint(0, 3, size=rows).astype(np.int32))
          for _ in range(steps)]


def _train(model_fn, batches=None, towers=None, static=False, **wrap_kwargs):
  """Trains `model_fn` on `batches`; returns (losses, {variable: value}).

  `towers=None` runs the model_fn unwrapped on one device. `static` gives
  the graph batches of known size, else placeholders of unknown size, as
  an input_fn ending in `.batch()` does (`harness.train`).
  """
  run = harness.train(model_fn, batches or _batches(), towers, static=static,
                      named_inputs=True, **wrap_kwargs)
  return run.per_step("loss"), run.variables


def _assert_same_training(expected, actual):
  expected_losses, expected_values = expected
  losses, values = actual
  assert sorted(values) == sorted(expected_values)
  for name, value in expected_values.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)


def _logits(features, **dense_kwargs):
  return tf.compat.v1.layers.dense(
      features["x"], 3, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.6, 0.6, 9).reshape(3, 3)), **dense_kwargs)


def _optimizer(name="sgd"):
  if name == "adam":
    return replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.1))
  return replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))


# ExponentialMovingAverage made after the update.


def _ema_model_fn(features, labels, mode):
  logits = _logits(features)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  step = _optimizer().minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  ema = tf.train.ExponentialMovingAverage(0.9)
  with tf.control_dependencies([step]):
    train_op = ema.apply(tf.compat.v1.trainable_variables())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_moving_average_after_the_update_moves_once_per_step(towers, strategy):
  expected = _train(_ema_model_fn)
  # After one step the shadow is 0.9 * w0 + 0.1 * w1, once, not N times.
  actual = _train(_ema_model_fn, towers=towers, variable_strategy=strategy)
  _assert_same_training(expected, actual)
  assert "logits/kernel/ExponentialMovingAverage" in actual[1]
  _assert_same_training(actual, _train(_ema_model_fn, towers=towers,
                                       variable_strategy=strategy))


# A step counter grouped with the update.


def _step_counter_model_fn(features, labels, mode):
  logits = _logits(features)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.group(
      _optimizer("adam").minimize(loss),
      tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(), 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("towers", [2, 3])
def test_step_counter_grouped_with_the_update_counts_steps(towers, static):
  expected = _train(_step_counter_model_fn, static=static)
  actual = _train(_step_counter_model_fn, towers=towers, static=static)
  assert actual[1]["global_step"] == STEPS
  _assert_same_training(expected, actual)


# A counter of rows seen: each tower counts its rows, the total is the batch.


def _rows_seen_model_fn(features, labels, mode):
  seen = tf.compat.v1.get_variable("seen", [], tf.int32, trainable=False,
                                   initializer=tf.zeros_initializer())
  logits = _logits(features)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.group(
      _optimizer().minimize(loss, tf.compat.v1.train.get_global_step()),
      seen.assign_add(tf.size(labels)))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("rows", [ROWS, 8])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("towers", [2, 3])
def test_rows_seen_counter_sums_over_towers(towers, static, rows):
  batches = _batches(rows)
  expected = _train(_rows_seen_model_fn, batches, static=static)
  actual = _train(_rows_seen_model_fn, batches, towers=towers, static=static)
  assert actual[1]["seen"] == rows * STEPS
  _assert_same_training(expected, actual)


def test_rows_seen_counter_ignores_a_tower_on_a_stand_in_row():
  batches = _batches(rows=2)  # 1 + 1 + a stand-in row on 3 towers
  actual = _train(_rows_seen_model_fn, batches, towers=3)
  assert actual[1]["seen"] == 2 * STEPS
  _assert_same_training(_train(_rows_seen_model_fn, batches), actual)


# Batch norm with UPDATE_OPS.


def _batch_norm_model_fn(momentum=0.9):

  def model_fn(features, labels, mode):
    normalized = tf.compat.v1.layers.batch_normalization(
        features["x"], momentum=momentum, training=True, name="bn")
    logits = _logits({"x": normalized})
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    update_ops = tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update_ops):
      train_op = _optimizer().minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _shards(batch, towers):
  base, extra = divmod(len(batch), towers)
  sizes = [base + (i < extra) for i in range(towers)]
  return np.split(batch, np.cumsum(sizes)[:-1])


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_batch_norm_moving_mean_moves_with_the_whole_batchs_mean(
    towers, strategy):
  batches = _batches(steps=1)
  _, expected = _train(_batch_norm_model_fn(), batches)
  # Per-tower batch norm, asked for (the default synchronizes): what the
  # rule for state makes of the towers' own moving-average writes.
  _, actual = _train(_batch_norm_model_fn(), batches, towers=towers,
                     variable_strategy=strategy, sync_batch_norm=False)
  x = batches[0][0]
  # moving_mean = 0 - (0 - mean(x)) * (1 - 0.9): the whole batch's mean.
  np.testing.assert_allclose(actual["bn/moving_mean"], 0.1 * x.mean(axis=0),
                             rtol=1e-5)
  np.testing.assert_allclose(actual["bn/moving_mean"], expected["bn/moving_mean"],
                             rtol=1e-5)
  # moving_variance = 1 - (1 - v) * 0.1 with v the rows-weighted mean of
  # the shards' variances (each tower normalises its own shard).
  shards = _shards(x, towers)
  shard_variance = sum(len(s) * s.var(axis=0) for s in shards) / len(x)
  np.testing.assert_allclose(actual["bn/moving_variance"],
                             1 - (1 - shard_variance) * 0.1, rtol=1e-5)


@pytest.mark.parametrize("towers", [3, 5])
def test_batch_norm_with_identical_shards_matches_one_device_exactly(towers):
  # Identical shards: the shard variance is the batch's, so every variable
  # (moving variance included) and every step must match, over 12 steps
  # with momentum 0.5 (5 towers each adding their update diverged).
  rows = np.tile(_batches(rows=2, steps=1)[0][0], (towers, 1))
  labels = np.tile(np.array([0, 2], np.int32), towers)
  batches = [(rows, labels)] * 12
  # Per-tower batch norm, asked for (the default is one device's on any
  # shards): the towers' own moving-average writes, combined.
  model_fn = _batch_norm_model_fn(momentum=0.5)
  expected = _train(model_fn, batches)
  actual = _train(model_fn, batches, towers=towers, sync_batch_norm=False)
  _assert_same_training(expected, actual)
  _assert_same_training(actual, _train(model_fn, batches, towers=towers,
                                       sync_batch_norm=False))


def _keras_batch_norm_model_fn(features, labels, mode):
  # Keras layers' updates are not in UPDATE_OPS: the model_fn groups them.
  batch_norm = tf.keras.layers.BatchNormalization(momentum=0.9, name="kbn")
  logits = _logits({"x": batch_norm(features["x"], training=True)})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.group(
      _optimizer().minimize(loss, tf.compat.v1.train.get_global_step()),
      *batch_norm.updates)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_keras_batch_norm_updates_grouped_with_the_train_op_move_once(
    towers, strategy):
  batches = _batches(steps=1)
  _, expected = _train(_keras_batch_norm_model_fn, batches)
  _, actual = _train(_keras_batch_norm_model_fn, batches, towers=towers,
                     variable_strategy=strategy)
  # 0 - (0 - mean(x)) * 0.1, with the whole batch's mean, once.
  np.testing.assert_allclose(actual["kbn/moving_mean"],
                             0.1 * batches[0][0].mean(axis=0), rtol=1e-5)
  np.testing.assert_allclose(actual["kbn/moving_mean"],
                             expected["kbn/moving_mean"], rtol=1e-5)


def test_batch_norm_ignores_a_tower_on_a_stand_in_row():
  batches = _batches(rows=2, steps=1)  # 1 + 1 + a stand-in row
  _, actual = _train(_batch_norm_model_fn(), batches, towers=3)
  np.testing.assert_allclose(actual["bn/moving_mean"],
                             0.1 * batches[0][0].mean(axis=0), rtol=1e-5)


# Regularization counts once.


def _regularized_model_fn(reduction, use_layers):

  def model_fn(features, labels, mode):
    regularizer = tf.keras.regularizers.l2(0.5)
    if use_layers:
      logits = _logits(features, kernel_regularizer=regularizer)
    else:
      kernel = tf.compat.v1.get_variable(
          "kernel", [3, 3], regularizer=regularizer,
          initializer=tf.compat.v1.constant_initializer(
              np.linspace(-0.6, 0.6, 9).reshape(3, 3)))
      logits = tf.matmul(features["x"], kernel)
    tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                     reduction=reduction)
    loss = tf.compat.v1.losses.get_total_loss()
    train_op = _optimizer().minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize("use_layers", [False, True])
@pytest.mark.parametrize("reduction", [Reduction.SUM, Reduction.MEAN])
@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_regularization_counts_once(towers, strategy, reduction, use_layers):
  model_fn = _regularized_model_fn(reduction, use_layers)
  expected = _train(model_fn)
  actual = _train(model_fn, towers=towers, variable_strategy=strategy,
                  loss_reduction=reduction)
  _assert_same_training(expected, actual)


def _regularization_losses_left(model_fn, towers, strategy):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    if towers:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=cpus(towers), variable_strategy=strategy)
    model_fn(features={"x": tf.ones([5, 3])}, labels=tf.zeros([5], tf.int32),
             mode=TRAIN)
    return [t.name for t in tf.compat.v1.losses.get_regularization_losses()]


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
def test_regularization_losses_after_the_call_are_the_unwrapped_ones(strategy):
  model_fn = _regularized_model_fn(Reduction.MEAN, use_layers=True)
  expected = _regularization_losses_left(model_fn, None, None)
  assert len(expected) == 1
  assert _regularization_losses_left(model_fn, 3, strategy) == expected


def _regularization_loss_model_fn(features, labels, mode):
  # A summed data loss plus get_regularization_loss(), with Reduction.SUM.
  kernel = tf.compat.v1.get_variable(
      "kernel", [3, 3], regularizer=tf.keras.regularizers.l2(1.0),
      initializer=tf.compat.v1.constant_initializer(1.0))
  logits = tf.matmul(features["x"], kernel)
  data_loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, reduction=Reduction.SUM)
  loss = data_loss + tf.compat.v1.losses.get_regularization_loss()
  train_op = _optimizer().minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [2, 3])
def test_summed_loss_with_regularization_loss_counts_it_once(towers):
  losses, _ = _train(_regularization_loss_model_fn, towers=towers,
                     loss_reduction=Reduction.SUM)
  expected_losses, _ = _train(_regularization_loss_model_fn)
  # The first loss: the data loss + 1.0 * sum(kernel ** 2) = + 9.0, once.
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert losses[0] > 9.0
  _assert_same_training(_train(_regularization_loss_model_fn),
                        _train(_regularization_loss_model_fn, towers=towers,
                               loss_reduction=Reduction.SUM))


# Weighted and masked losses, with replicate.loss_denominator.


def _weighted_model_fn(reduction, denominator, weights_of):

  def model_fn(features, labels, mode):
    logits = _logits(features)
    weights = weights_of(features["x"])
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, weights=weights, reduction=reduction)
    replicate.loss_denominator(denominator(weights))
    train_op = _optimizer("adam").minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _zero_or_one(x):
  return tf.cast(x[:, 0] > 0, tf.float32)  # some rows weigh 0


def _one_to_five(x):
  return tf.round(2 + 3 * x[:, 1])  # weights from 0 to 5


WEIGHTED_CASES = {
    "nonzero weights": (Reduction.SUM_BY_NONZERO_WEIGHTS, _zero_or_one,
                        tf.math.count_nonzero),
    "weighted mean": (Reduction.MEAN, _one_to_five, tf.reduce_sum),
    "sum over nonzero weights": (Reduction.SUM_OVER_NONZERO_WEIGHTS,
                                 _one_to_five, tf.math.count_nonzero),
}


@pytest.mark.parametrize("case", sorted(WEIGHTED_CASES))
@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_loss_denominator_makes_weighted_losses_exact(towers, strategy, case):
  reduction, weights_of, denominator = WEIGHTED_CASES[case]
  model_fn = _weighted_model_fn(reduction, denominator, weights_of)
  expected = _train(model_fn)
  actual = _train(model_fn, towers=towers, variable_strategy=strategy,
                  loss_reduction=reduction)
  _assert_same_training(expected, actual)


def _token_mean_model_fn(features, labels, mode):
  # A mean over the tokens a padding mask keeps: 3 tokens per row.
  tokens = tf.compat.v1.layers.dense(
      features["x"], 9, name="tokens",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.5, 0.5, 27).reshape(3, 9)))
  logits = tf.reshape(tokens, [-1, 3, 3])
  token_labels = tf.stack([labels, (labels + 1) % 3, labels], axis=1)
  mask = tf.cast(features["x"] > -0.3, tf.float32)  # 0 to 3 tokens a row
  per_token = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      token_labels, logits, reduction=Reduction.NONE)
  denominator = tf.reduce_sum(mask)
  loss = tf.math.divide_no_nan(tf.reduce_sum(per_token * mask), denominator)
  replicate.loss_denominator(denominator)
  train_op = _optimizer().minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [2, 3])
def test_loss_denominator_makes_a_masked_token_mean_exact(towers):
  _assert_same_training(_train(_token_mean_model_fn),
                        _train(_token_mean_model_fn, towers=towers))


def test_loss_denominator_with_a_stand_in_tower_weighs_it_zero():
  reduction, weights_of, denominator = WEIGHTED_CASES["weighted mean"]
  model_fn = _weighted_model_fn(reduction, denominator, weights_of)
  batches = _batches(rows=2)  # tower 2 runs on a stand-in row
  _assert_same_training(_train(model_fn, batches),
                        _train(model_fn, batches, towers=3,
                               loss_reduction=reduction))


def test_loss_denominator_outside_replicate_does_nothing():
  with tf.Graph().as_default():
    value = replicate.loss_denominator(3)
    assert value.dtype == tf.int32
    assert tf.get_static_value(value) == 3


# Global-norm clipping: of the whole batch's gradients, between
# compute_gradients and apply_gradients as in a transformer.


def _clipped_model_fn(as_transformer):

  def model_fn(features, labels, mode):
    logits = _logits(features)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    clip = lambda pairs: list(zip(
        tf.clip_by_global_norm([g for g, _ in pairs], 0.05)[0],
        [v for _, v in pairs]))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0),
        gradient_transformers=[clip] if as_transformer else None)
    pairs = optimizer.compute_gradients(loss)
    if not as_transformer:
      pairs = clip(pairs)
    train_op = optimizer.apply_gradients(
        pairs, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [1, 2, 3])
def test_gradient_transformers_clip_the_summed_gradients(towers, strategy):
  # Unwrapped, clipping in apply_gradients clips the batch's gradient; a
  # transformer clips the summed gradients, the same thing.
  expected = _train(_clipped_model_fn(as_transformer=False))
  _assert_same_training(expected, _train(_clipped_model_fn(True)))
  _assert_same_training(expected, _train(_clipped_model_fn(True),
                                         towers=towers,
                                         variable_strategy=strategy))


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_clipping_between_compute_and_apply_clips_the_batch(towers, strategy):
  # API.md, "Batch-level values are the whole batch's": compute_gradients
  # gives the sums over towers, so the clip is one device's (it clipped
  # each tower's own gradients until issue 30).
  _assert_same_training(
      _train(_clipped_model_fn(as_transformer=False)),
      _train(_clipped_model_fn(as_transformer=False), towers=towers,
             variable_strategy=strategy))


# A Saver in the Scaffold, built after the optimizer: it must save the
# optimizer's slots, so that training resumes.


def _saver_model_fn(family):

  def model_fn(features, labels, mode):
    logits = _logits(features)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    global_step = tf.compat.v1.train.get_global_step()
    if family == "keras":
      optimizer = replicate.TowerOptimizer(
          tf.keras.optimizers.legacy.Adam(0.1))
      optimizer.iterations = global_step
      train_op = optimizer.get_updates(
          loss, tf.compat.v1.trainable_variables())[0]
    else:
      train_op = _optimizer("adam").minimize(loss, global_step=global_step)
    scaffold = tf.compat.v1.train.Scaffold(saver=tf.compat.v1.train.Saver())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      scaffold=scaffold)

  return model_fn


def _input_fn():
  x, y = _batches(rows=14, steps=1)[0]
  return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(ROWS)


def _train_twice(model_fn, model_dir, towers=None, **wrap_kwargs):
  if towers is not None:
    model_fn = replicate.replicate_model_fn(model_fn, **wrap_kwargs)
  estimator = tf.estimator.Estimator(
      model_fn, model_dir=model_dir, config=tf.estimator.RunConfig(
          session_config=session_config(towers or 1)))
  estimator.train(_input_fn)  # 2 steps, then a resume from the checkpoint
  estimator.train(_input_fn)
  reader = tf.train.load_checkpoint(model_dir)
  return {name: reader.get_tensor(name)
          for name, _ in tf.train.list_variables(model_dir)}


@pytest.mark.parametrize("family", ["v1", "keras"])
@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_saver_built_after_the_optimizer_saves_its_slots(
    towers, strategy, family, tmp_path):
  expected = _train_twice(_saver_model_fn(family), str(tmp_path / "one"))
  actual = _train_twice(_saver_model_fn(family), str(tmp_path / "towers"),
                        towers, variable_strategy=strategy)
  assert expected["global_step"] == 4
  assert any(name.endswith("/Adam") or name.endswith("/m")
             for name in expected)
  assert sorted(actual) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


# Keras layers' own regularization losses, summed by the model_fn.


def _keras_losses_model_fn(features, labels, mode):
  layer = tf.keras.layers.Dense(
      3, kernel_regularizer=tf.keras.regularizers.l2(0.5),
      kernel_initializer=tf.keras.initializers.Constant(
          np.linspace(-0.6, 0.6, 9).reshape(3, 3)))
  logits = layer(features["x"])
  loss = (tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits) +
          tf.math.add_n(layer.losses))
  train_op = _optimizer().minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("strategy", [PS, REPLICATED])
@pytest.mark.parametrize("towers", [2, 3])
def test_keras_layer_losses_count_once_with_an_averaging_reduction(
    towers, strategy):
  _assert_same_training(_train(_keras_losses_model_fn),
                        _train(_keras_losses_model_fn, towers=towers,
                               variable_strategy=strategy))
