"""Splitting batches into tower shards, and each shard's loss weight."""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import cpus, regression_spec, run_initialized
from conftest import session_config
from replicate.shard import sharding

Reduction = tf.compat.v1.losses.Reduction


@pytest.mark.parametrize("batch_size, towers, expected", [
    (12, 3, [4, 4, 4]),
    (7, 3, [3, 2, 2]),  # 7 = 3*2 + 1: the first shard takes the extra row
    (8, 3, [3, 3, 2]),
    (2, 3, [1, 1, 0]),  # fewer rows than towers: the last tower is empty
    (0, 2, [0, 0]),
])
def test_shard_sizes_static_and_dynamic_agree(graph, batch_size, towers,
                                              expected):
  assert sharding.shard_sizes(batch_size, towers) == expected
  dynamic = sharding.shard_sizes(tf.constant(batch_size), towers)
  assert run_initialized(dynamic).tolist() == expected


def test_dense_rows_split_in_order_unevenly(graph):
  x = np.arange(14, dtype=np.float32).reshape(7, 2)
  shards = sharding.split_batch({"x": x}, x[:, :1], 3)
  assert shards.sizes == [3, 2, 2]
  assert shards.batch_size == 7
  features, labels = run_initialized((shards.features, shards.labels))
  np.testing.assert_array_equal(features[0]["x"], x[0:3])
  np.testing.assert_array_equal(features[1]["x"], x[3:5])
  np.testing.assert_array_equal(features[2]["x"], x[5:7])
  np.testing.assert_array_equal(np.concatenate(labels), x[:, :1])


def test_unknown_batch_size_is_split_at_run_time(graph):
  x = tf.compat.v1.placeholder(tf.float32, [None, 2])
  shards = sharding.split_batch(x, None, 3)
  assert shards.labels == [None, None, None]
  values = np.arange(10, dtype=np.float32).reshape(5, 2)
  parts = run_initialized(shards.features, {x: values})
  assert [len(p) for p in parts] == [2, 2, 1]  # 5 = 3*1 + 2
  np.testing.assert_array_equal(np.concatenate(parts), values)


@pytest.mark.parametrize("feed_batch_size", [False, True])
def test_a_tower_without_rows_stands_in_the_first_row(graph, feed_batch_size):
  values = np.array([[1.0, 2.0], [3.0, 4.0]])
  x = (tf.compat.v1.placeholder(tf.float64, [None, 2]) if feed_batch_size
       else tf.constant(values))
  shards = sharding.split_batch(x, None, 3)
  assert shards.may_stand_in
  parts, sizes = run_initialized(
      (shards.features, tf.convert_to_tensor(shards.sizes)),
      {x: values} if feed_batch_size else None)
  # sizes 1, 1, 0: tower 2 runs on a copy of row 0, its weight is 0.
  assert [p.tolist() for p in parts] == [[[1.0, 2.0]], [[3.0, 4.0]],
                                         [[1.0, 2.0]]]
  assert sizes.tolist() == [1, 1, 0]


def test_every_tower_with_rows_means_one_split_op(graph):
  shards = sharding.split_batch(tf.ones([6, 2]), None, 3)
  assert not shards.may_stand_in
  assert [op.type for op in graph.get_operations()].count("SplitV") == 1


def test_nested_dict_features_are_split_leaf_by_leaf(graph):
  features = {"a": {"b": np.arange(4.0), "c": np.ones([4, 3])}}
  shards = sharding.split_batch(features, None, 2)
  first = run_initialized(shards.features[0])
  np.testing.assert_array_equal(first["a"]["b"], [0.0, 1.0])
  assert first["a"]["c"].shape == (2, 3)


def _sparse_rows(rows, columns=4):
  """A SparseTensorValue with rows[i] ids in row i."""
  indices = [[r, c] for r, ids in enumerate(rows) for c in range(len(ids))]
  values = [v for ids in rows for v in ids]
  return tf.compat.v1.SparseTensorValue(
      np.array(indices, np.int64).reshape(-1, 2), np.array(values, np.int64),
      [len(rows), columns])


@pytest.mark.parametrize("rows, towers", [
    ([[1], [2, 3], [], [4, 5, 6], [7]], 2),  # uneven: 3 + 2 rows
    ([[1, 2], [3]], 3),  # fewer rows than towers: tf.sparse.split refuses
])
def test_sparse_rows_split_like_dense_rows(graph, rows, towers):
  placeholder = tf.compat.v1.sparse_placeholder(tf.int64)
  dense = tf.compat.v1.placeholder(tf.float32, [None])
  shards = sharding.split_batch({"ids": placeholder, "x": dense}, None, towers)
  value = _sparse_rows(rows)
  parts = run_initialized(
      [tf.sparse.to_dense(f["ids"]) for f in shards.features],
      {placeholder: value, dense: np.zeros(len(rows))})
  expected = run_initialized(tf.sparse.to_dense(value))
  sizes = sharding.shard_sizes(len(rows), towers)
  # Each shard keeps its row count, empty rows included; a shard without
  # rows stands in the first row.
  assert [p.shape[0] for p in parts] == [max(size, 1) for size in sizes]
  np.testing.assert_array_equal(
      np.concatenate([p[:size] for p, size in zip(parts, sizes)]), expected)


def test_shares_are_parts_of_the_batch(graph):
  assert sharding.shard_shares([3, 2, 2], 7) == [3 / 7, 2 / 7, 2 / 7]
  sizes = sharding.shard_sizes(tf.constant(7), 3)
  dynamic = sharding.shard_shares(sizes, tf.constant(7))
  np.testing.assert_allclose(run_initialized(dynamic), [3 / 7, 2 / 7, 2 / 7])


def test_empty_batch_weighs_zero_not_nan(graph):
  batch_size = tf.constant(0)
  sizes = sharding.shard_sizes(batch_size, 2)
  weights = run_initialized(sharding.shard_shares(sizes, batch_size))
  assert weights == [0.0, 0.0]
  assert run_initialized(sharding.shard_has_rows(sizes)) == [False, False]
  # Known to be empty when the graph is built: the batch is tower 0's.
  assert sharding.shard_shares([0, 0], 0) == [1.0, 0.0]
  assert sharding.shard_has_rows([0, 0, 0]) == [True, False, False]


def test_static_dimension_0_mismatch_names_both(graph):
  with pytest.raises(ValueError) as error:
    sharding.split_batch({"a": np.ones([4, 2])}, np.ones([5]), 2)
  message = str(error.value)
  assert "features['a'] has 4 rows" in message and "labels has 5" in message


def test_run_time_dimension_0_mismatch_is_invalid_argument(graph):
  a = tf.compat.v1.placeholder(tf.float32, [None])
  b = tf.compat.v1.placeholder(tf.float32, [None])
  shards = sharding.split_batch({"a": a, "b": b}, None, 2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="must share dimension 0"):
    run_initialized(shards.features, {a: np.ones(4), b: np.ones(3)})


@pytest.mark.parametrize("make_features, expected", [
    (lambda: {"age": tf.constant(3.0)}, r"features\['age'\] is a scalar"),
    (lambda: {"r": tf.ragged.constant([[1], [2, 3]])}, "is a RaggedTensor"),
    (lambda: {"s": "text"}, "is a str"),
    (lambda: {}, "hold no tensor"),
])
def test_unsplittable_inputs_are_clear_errors(graph, make_features, expected):
  with pytest.raises(ValueError, match=expected):
    sharding.split_batch(make_features(), None, 2)


def _empty_batch_model_fn(features, labels, mode,
                          reduction=Reduction.SUM_BY_NONZERO_WEIGHTS):
  w = tf.compat.v1.get_variable(
      "w", [4, 1], initializer=tf.compat.v1.constant_initializer(
          [1.0, 2.0, 3.0, 4.0]))
  predictions = tf.matmul(features, w)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  if reduction == Reduction.SUM_BY_NONZERO_WEIGHTS:
    return regression_spec(mode, labels, predictions,
                           tf.compat.v1.train.AdamOptimizer(0.1))
  # The loss reduced as loss_reduction says (the loss rule refuses a
  # loss_reduction the graph contradicts).
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions,
                                                reduction=reduction)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op,
      eval_metric_ops={"mae": tf.compat.v1.metrics.mean_absolute_error(
          labels, predictions)})


def _on_an_empty_batch(model_fn, mode):
  """Builds `model_fn` on constant features [0, 4]; runs one step."""
  with tf.Graph().as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    del global_step  # created as the Estimator does; a global variable
    spec = model_fn(tf.zeros([0, 4]), tf.zeros([0, 1]), mode)
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      if mode == tf.estimator.ModeKeys.TRAIN:
        loss, _ = session.run([spec.loss, spec.train_op])
        variables = tf.compat.v1.global_variables()
        return [loss] + session.run(variables), dict(zip(
            [v.op.name for v in variables], session.run(variables)))
      if mode == tf.estimator.ModeKeys.EVAL:
        session.run(spec.eval_metric_ops["mae"][1])
        return session.run([spec.loss, spec.eval_metric_ops["mae"][0]]), {}
      return [session.run(spec.predictions)], {}


@pytest.mark.parametrize("reduction", [Reduction.SUM_BY_NONZERO_WEIGHTS,
                                       Reduction.SUM])
@pytest.mark.parametrize("towers", [2, 3])
def test_a_batch_known_to_be_empty_trains_a_no_op_step_as_unwrapped(
    towers, reduction):
  model_fn = functools.partial(_empty_batch_model_fn, reduction=reduction)
  wrapped = replicate.replicate_model_fn(
      model_fn, devices=cpus(towers), loss_reduction=reduction)
  for mode in (tf.estimator.ModeKeys.TRAIN, tf.estimator.ModeKeys.EVAL,
               tf.estimator.ModeKeys.PREDICT):
    expected, _ = _on_an_empty_batch(model_fn, mode)
    got, got_variables = _on_an_empty_batch(wrapped, mode)
    assert len(got) == len(expected), mode
    for got_value, expected_value in zip(got, expected):
      np.testing.assert_array_equal(got_value, expected_value, err_msg=mode)
    if mode == tf.estimator.ModeKeys.TRAIN:
      # Unwrapped: a mean over no rows is 0, so the gradient is 0; the step
      # counts, Adam's beta1 power advances (0.9 -> 0.81), w stays.
      assert got[0] == 0.0
      assert got_variables["global_step"] == 1
      np.testing.assert_array_equal(got_variables["w"].ravel(),
                                    [1.0, 2.0, 3.0, 4.0])
      assert got_variables["beta1_power"] == pytest.approx(0.81)
      assert not got_variables["w/Adam"].any()
    if mode == tf.estimator.ModeKeys.PREDICT:
      assert got[0].shape == (0, 1)


@pytest.mark.parametrize("shape", [[2, 3], [None, 3]], ids=["static", "dynamic"])
def test_zero_unless_rows_passes_the_tensor_or_zeros_never_nan(graph, shape):
  value = tf.compat.v1.placeholder(tf.float32, shape)
  has_rows = tf.compat.v1.placeholder(tf.bool, [])
  chosen = sharding.zero_unless_rows(value * 1.0, has_rows)
  slices = sharding.zero_unless_rows(
      tf.IndexedSlices(value * 1.0, tf.constant([4, 1])), has_rows)
  assert chosen.shape.as_list() == shape
  rows = np.array([[1.0, np.inf, 3.0], [np.nan, 5.0, -6.0]], np.float32)
  with tf.compat.v1.Session() as session:  # grappler's folding on, as always
    kept, kept_slices = session.run([chosen, slices.values],
                                    {value: rows, has_rows: True})
    np.testing.assert_array_equal(kept, rows)
    np.testing.assert_array_equal(kept_slices, rows)
    zeros, zero_slices = session.run([chosen, slices.values],
                                     {value: rows, has_rows: False})
  assert zeros.tolist() == [[0.0] * 3] * 2
  assert zero_slices.tolist() == [[0.0] * 3] * 2


def test_zero_unless_rows_forwards_the_tensor_without_an_elementwise_op(graph):
  # A tf.where would copy every gradient of every tower on every step; the
  # tensor goes through Switch and Merge, which pass it on as it is.
  with tf.device("/cpu:1"):
    gradient = tf.ones([1024, 1024]) * 2.0
  chosen = sharding.zero_unless_rows(gradient, tf.compat.v1.placeholder(
      tf.bool, []))
  assert chosen.op.type == "Merge"
  switch = chosen.op.inputs[0].op
  assert switch.type == "Switch" and switch.inputs[0] is gradient
  assert switch.device == chosen.op.device == "/device:CPU:1"


def _mean_model_fn(features, labels, mode):
  """A plain tf.reduce_mean loss: NaN on a batch of no rows."""
  w = tf.compat.v1.get_variable(
      "w", [2, 1], initializer=tf.compat.v1.constant_initializer([0.5, -1.0]))
  loss = tf.reduce_mean(tf.square(tf.matmul(features, w) - labels))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [2, 3])
def test_a_batch_empty_at_run_time_trains_a_finite_no_op_step(towers):
  # What zero weight alone would give, and why towers without rows are
  # still chosen away: on a batch found empty at run time a tower's
  # gradients are sums over no rows, exactly 0 even under weight 0, but its
  # mean loss is 0 / 0, and 0 x NaN is NaN. The step still counts.
  wrapped = replicate.replicate_model_fn(_mean_model_fn, devices=cpus(towers))
  with tf.Graph().as_default() as graph:
    features = tf.compat.v1.placeholder(tf.float32, [None, 2])
    labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = wrapped(features, labels, tf.estimator.ModeKeys.TRAIN)
    tower_loss = graph.get_tensor_by_name("tower_1/Mean:0")
    weighted_alone = 0.0 * tower_loss
    gradient_alone = tf.gradients(weighted_alone,
                                  tf.compat.v1.trainable_variables())[0]
    empty = {features: np.zeros([0, 2]), labels: np.zeros([0, 1])}
    with tf.compat.v1.Session(config=session_config(towers)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      alone, gradient = session.run([weighted_alone, gradient_alone], empty)
      loss, _ = session.run([spec.loss, spec.train_op], empty)
      w, step = session.run([tf.compat.v1.trainable_variables()[0],
                             tf.compat.v1.train.get_global_step()])
  assert np.isnan(alone) and gradient.ravel().tolist() == [0.0, 0.0]
  assert loss == 0.0 and step == 1
  assert w.ravel().tolist() == [0.5, -1.0]


def test_a_python_share_keeps_float64_precision(graph):
  # tf.cast(7 / 13, tf.float64) would round 7/13 to float32 first
  # (0.53846156597137451...), 1.2e-8 off: a float64 model's towers would
  # weigh their losses and statistics to float32's precision.
  share = run_initialized(sharding.weight_as(7 / 13, tf.float64))
  assert share == 7 / 13
  tensor_share = run_initialized(sharding.weight_as(
      tf.constant(0.5, tf.float32), tf.float64))
  assert tensor_share == 0.5
