"""Rows that meet, failing closed: an op type the rule does not know.

An op on the path from tower 0's rows to the loss whose type is neither known to keep rows apart (`replicate.graph.row_ops`)
nor has a rule of its own (`replicate.shard.rows_meet`) is refused at graph
build, naming its type and name, with the fix: compute it on
`replicate.all_rows(x)` and take the tower's rows back with
`replicate.row_offset()`. The fix is checked to train like the unwrapped
model on one device (2 and 3 towers, 7 rows: 4 + 3 and 3 + 2 + 2). On main
(2c8ec8c) a `py_func` that centres the batch trained silently on each
shard's own mean (`test_an_unknown_op_on_the_rows_is_refused` names it).
Ops off the path (a summary, the backward pass, values of variables only)
are not refused.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import IS_TF1_BEHAVIOR, PREDICT, TRAIN, cpus, session_config
from replicate.graph import row_ops, row_rules

ROWS = 7
STEPS = 2


def _centred(x):
  """A custom op that combines rows: `x` minus the batch's mean, in numpy,
  with its gradient (the mean of the upstream gradient taken off)."""
  @tf.custom_gradient
  def centre(value):
    result = tf.compat.v1.py_func(
        lambda a: a - a.mean(axis=0, keepdims=True), [value], tf.float32)
    result.set_shape(value.shape)
    return result, lambda dy: dy - tf.reduce_mean(dy, axis=0, keepdims=True)
  return centre(x)


def _model_fn(combine):
  def model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.dense(
        features["x"], 4, activation=tf.nn.tanh, name="hidden",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    output = tf.compat.v1.layers.dense(
        combine(hidden), 1, name="output",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    if mode == PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions={"y": output})
    loss = tf.compat.v1.losses.mean_squared_error(labels, output)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=optimizer.minimize(
            loss, global_step=tf.compat.v1.train.get_global_step()))
  return model_fn


def _the_fix(hidden):
  """The refusal's fix: the op on the whole batch, the tower's rows back."""
  whole = _centred(replicate.all_rows(hidden))
  return whole[replicate.row_offset():][:tf.shape(hidden)[0]]


def _data(seed=0):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=(ROWS, 3)).astype(np.float32),
          rng.normal(size=(ROWS, 1)).astype(np.float32))


def _input(x, y, mode):
  """The batch from a dataset, of a size unknown when the graph is built."""
  dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(ROWS)
  features, labels = tf.compat.v1.data.make_one_shot_iterator(
      dataset.repeat()).get_next()
  return features, (None if mode == PREDICT else labels)


def _build(model_fn, towers, mode=TRAIN):
  if towers:
    model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers))
  features, labels = _input(*_data(), mode)
  return model_fn(features=features, labels=labels, mode=mode)


def _train(model_fn, towers=None):
  """Variables after STEPS SGD steps, then the predictions with them."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(model_fn, towers)
    with tf.compat.v1.Session(config=session_config(4)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(STEPS):
        session.run(spec.train_op)
      values = {v.op.name: session.run(v)
                for v in tf.compat.v1.global_variables()
                if not v.op.name.startswith("tower_")}
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(model_fn, towers, PREDICT)
    with tf.compat.v1.Session(config=session_config(4)) as session:
      for variable in tf.compat.v1.global_variables():
        if variable.op.name in values:
          variable.load(values[variable.op.name], session)
      values["predictions"] = session.run(spec.predictions["y"])
  return values


UNKNOWN = {
    "py_func": (_centred, "PyFunc"),
    "shuffle_of_the_rows": (
        lambda h: h + tf.stop_gradient(tf.random.shuffle(h, seed=1)),
        "RandomShuffle"),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_an_unknown_op_on_the_rows_is_refused(name):
  combine, op_type = UNKNOWN[name]
  assert not row_ops.keeps_rows_apart(op_type)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=(
        r"The {} op '[^']+' is on the path from the tower's rows.*cannot "
        r"tell whether it keeps the batch's rows apart.*Fix:.*"
        r"my_op\(replicate\.all_rows\(x\)\)\[replicate\.row_offset\(\):\]"
        r"\[:tf\.shape\(x\)\[0\]\]").format(op_type)):
      _build(_model_fn(combine), towers=2)


@pytest.mark.parametrize("towers", [2, 3])
def test_the_fix_trains_like_one_device(towers):
  expected = _train(_model_fn(_the_fix))
  actual = _train(_model_fn(_the_fix), towers)
  assert sorted(expected) == sorted(actual)
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # The op combines rows: per shard it would not have been one device.
  assert not np.allclose(expected["predictions"],
                         _train(_model_fn(_per_shard_centred))["predictions"],
                         atol=1e-3)


def _per_shard_centred(hidden):
  """What each tower would compute alone (its first 4 rows' mean)."""
  first, rest = hidden[:4], hidden[4:]
  return tf.concat([_centred(first), _centred(rest)], 0)


def _summarised(hidden):
  tf.compat.v1.summary.scalar("centred", tf.reduce_mean(_centred(hidden)))
  return hidden


def _backward_only(hidden):
  @tf.custom_gradient
  def scaled(value):
    def grad(dy):
      doubled = tf.compat.v1.py_func(lambda a: 2.0 * a, [dy], tf.float32)
      doubled.set_shape(dy.shape)
      return doubled
    return tf.identity(value), grad
  return scaled(hidden)


def _variables_only(hidden):
  scale = tf.compat.v1.get_variable("scale", [4],
                                    initializer=tf.ones_initializer())
  rescaled = tf.compat.v1.py_func(lambda a: a * 1.0, [scale], tf.float32)
  return hidden * tf.reshape(rescaled, [4])


OFF_THE_PATH = {
    "summary": _summarised,
    "backward_pass_only": _backward_only,
    "variables_only": _variables_only,
    "roll_within_rows": lambda h: tf.roll(h, 1, axis=1),
    # The Transformer's decoder bias: a matrix of the rows' length only.
    "band_part_of_a_shape": lambda h: h + tf.reduce_sum(tf.linalg.band_part(
        tf.ones([tf.shape(h)[0], tf.shape(h)[0]]), -1, 0)),
    "band_part_within_rows": lambda h: tf.reduce_sum(tf.linalg.band_part(
        h[:, :, None] * h[:, None, :], -1, 0), 2),
    "sparse_rows_times_weights": lambda h: h + tf.sparse.sparse_dense_matmul(
        tf.sparse.from_dense(tf.cast(h > 0, tf.float32)), tf.ones([4, 4])),
    "reverse_within_rows": lambda h: tf.reverse(h, axis=[-1]),
    # A ragged reduction: segment ids are each value's own row.
    "ragged_mean_within_rows": lambda h: h * tf.reduce_mean(
        tf.RaggedTensor.from_tensor(h, lengths=tf.cast(
            tf.abs(h[:, 0]) * 2, tf.int64) % 3 + 1), axis=1)[:, None],
    # TF-Ranking's item order: a range of the list's size, not the rows'.
    "reverse_of_a_range_of_another_axis": lambda h: h * tf.reverse(
        tf.cast(tf.range(tf.shape(h)[1]), tf.float32), [0]),
}


@pytest.mark.parametrize("name", sorted(OFF_THE_PATH))
def test_ops_off_the_path_or_within_rows_are_not_refused(name):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(_model_fn(OFF_THE_PATH[name]), towers=2)
  assert spec.train_op is not None


COMBINING = {
    "diag_part_of_the_rows": (
        lambda h: h + tf.reduce_sum(tf.linalg.diag_part(h)),
        "MatrixDiagPartV3", "matrix axis"),
    "inverse_of_the_rows": (
        lambda h: h * tf.reduce_sum(tf.linalg.inv(h[:4])), "MatrixInverse",
        "matrix axis"),
    # `tf.sort` negates the transposed rows before its TopKV2: the row
    # analysis, not the transpose, says the rows are last (on f65e512 it
    # passed, and trained 1.12 off one device on 2 towers).
    "sort_down_the_batch": (
        lambda h: tf.transpose(tf.sort(tf.transpose(h), axis=1)), "TopKV2",
        "along the batch axis"),
    "sparse_rows_transposed": (
        lambda h: h * tf.reduce_sum(tf.sparse.sparse_dense_matmul(
            tf.sparse.from_dense(tf.cast(h > 0, tf.float32)), h,
            adjoint_a=True)), "SparseTensorDenseMatMul", "transpose"),
}


@pytest.mark.parametrize("name", sorted(COMBINING))
def test_linear_algebra_over_the_batch_axis_is_refused(name):
  combine, op_type, why = COMBINING[name]
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=r"The {} op '[^']+' combines "
                       r"different rows.*{}".format(op_type, why)):
      _build(_model_fn(combine), towers=2, mode=TRAIN)


def _gather_reversed(h):
  return tf.gather(h, tf.range(tf.shape(h)[0] - 1, -1, -1))


@pytest.mark.parametrize("op, axis", [("roll", 0), ("reverse", 0),
                                      ("roll", -2), ("gather", 0)])
def test_moving_rows_along_the_batch_axis_is_refused(op, axis):
  move = {"roll": lambda h: tf.roll(h, 1, axis=axis),
          "reverse": lambda h: tf.reverse(h, axis=[axis]),
          "gather": _gather_reversed}[op]
  op_type = {"roll": "Roll", "reverse": "ReverseV2", "gather": "GatherV2"}[op]
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=r"The {} op '[^']+' combines "
                       r"different rows.*(batch axis|not each row's own "
                       r"position)".format(op_type)):
      _build(_model_fn(lambda h: h * move(h)), towers=2)


# Slices of the rows' axis that are not the whole axis pick rows by their
# position in the shard: `h * h[0]` trained 0.15 off on 2 towers, silently,
# on f65e512 (StridedSlice was a layout op).
SLICING_ROWS = {
    "first_row": lambda h: h * h[0],
    "first_rows": lambda h: h * tf.reduce_sum(h[:2], axis=0),
    "rows_rotated": lambda h: tf.concat([h[1:], h[:1]], axis=0),
    "every_other_row": lambda h: h * tf.reduce_mean(h[::2], axis=0),
    "tf_slice_of_rows": lambda h: h * tf.reduce_sum(
        tf.slice(h, [1, 0], [2, -1]), axis=0),
}
WHOLE_ROWS_AXIS = {
    "up_to_the_rows_count": lambda h: h[:tf.shape(h)[0]] * 2.0,
    "columns": lambda h: tf.concat([h[:, :2], h[..., 2:]], axis=1),
    "tf_slice_of_columns": lambda h: tf.slice(h, [0, 1], [-1, 3]),
    "first_column": lambda h: h * h[:, 0:1],
}


@pytest.mark.parametrize("name", sorted(SLICING_ROWS))
def test_a_slice_of_the_rows_axis_on_the_loss_path_is_refused(name):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=(
        r"The (Strided)?Slice op '[^']+' combines different rows.*slices "
        r"the rows' axis: it picks .* by position in the tower's shard.*"
        r"replicate.all_rows")):
      _build(_model_fn(SLICING_ROWS[name]), towers=2)


@pytest.mark.parametrize("name", sorted(WHOLE_ROWS_AXIS))
def test_a_slice_keeping_the_rows_axis_trains_like_one_device(name):
  expected = _train(_model_fn(WHOLE_ROWS_AXIS[name]))
  actual = _train(_model_fn(WHOLE_ROWS_AXIS[name]), 2)
  for key, value in expected.items():
    np.testing.assert_allclose(actual[key], value, rtol=1e-5, atol=1e-6,
                               err_msg=key)


def test_the_known_op_types_are_real_and_apart_from_the_rules():
  for family, (why, types) in row_ops.FAMILIES.items():
    assert why and types, family
    assert not [t for t in types if not hasattr(tf.raw_ops, t)], family
  assert all(hasattr(tf.raw_ops, t) for t in row_rules.ROW_COMBINING)
  assert not row_ops.KEEPS_ROWS_APART & set(row_rules.ROW_COMBINING)
  for refused in ("PyFunc", "EagerPyFunc", "RandomShuffle", "Bincount",
                  "UniqueWithCounts", "MatrixDiagPartV3", "ScatterNd"):
    assert not row_ops.keeps_rows_apart(refused)


def _numpy_centred(hidden):
  result = tf.numpy_function(lambda a: a - a.mean(axis=0, keepdims=True),
                             [hidden], tf.float32)
  result.set_shape(hidden.shape)
  return result


@tf.function
def _in_a_function(hidden):
  return _numpy_centred(hidden)


INSIDE_A_FUNCTION = {
    "tf_function": _in_a_function,
    "tf_cond": lambda h: tf.cond(tf.reduce_all(tf.shape(h) > 0),
                                 lambda: _numpy_centred(h), lambda: h),
}


@pytest.mark.parametrize("name", sorted(INSIDE_A_FUNCTION))
def test_an_unknown_op_inside_a_function_on_the_rows_is_refused(name):
  # Under TF 1 behaviour a tf.cond is Switch and Merge: no function.
  inside = r" \(inside the function '[^']+' calls\)"
  if IS_TF1_BEHAVIOR and name == "tf_cond":
    inside = ""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=(
        r"The PyFunc op '[^']+'{} is on the path from the tower's rows.*"
        r"cannot tell".format(inside))):
      _build(_model_fn(INSIDE_A_FUNCTION[name]), towers=2, mode=TRAIN)


SOFTMAX_OVER_THE_BATCH = {
    "softmax_axis_0": lambda h: tf.nn.softmax(h, axis=0),
    "log_softmax_axis_0": lambda h: tf.nn.log_softmax(h, axis=0),
    "softmax_of_one_value_per_row": lambda h: h * tf.nn.softmax(h[:, 0])[
        :, None],
    "xent_axis_0": lambda h: h * tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.nn.softmax(h), logits=h, axis=0)[None, :],
}


@pytest.mark.parametrize("name", sorted(SOFTMAX_OVER_THE_BATCH))
def test_a_softmax_over_the_batch_is_refused(name):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=r"op '[^']+' combines different "
                       r"rows.*(over the batch|along the batch axis)"):
      _build(_model_fn(SOFTMAX_OVER_THE_BATCH[name]), towers=2)


@pytest.mark.parametrize("axis", [-1, 1])
def test_a_softmax_within_rows_is_not_refused(axis):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(_model_fn(lambda h: tf.nn.softmax(
        tf.reshape(h, [-1, 2, 2]), axis=axis)[:, :, 0]), towers=2)
  assert spec.train_op is not None


def test_a_float_cumsum_whose_axis_is_not_known_is_refused():
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    axis = tf.compat.v1.placeholder_with_default(1, [])
    with pytest.raises(ValueError, match=r"The Cumsum op '[^']+' combines "
                       r"different rows.*axis is not known"):
      _build(_model_fn(lambda h: tf.cumsum(h, axis=axis)), towers=2)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(_model_fn(lambda h: tf.cumsum(h, axis=1)), towers=2,
                  mode=PREDICT)
  assert spec.predictions is not None


REFUSED_ON_THE_LOSS_PATH = dict(
    [(name, combine) for name, (combine, _, _) in COMBINING.items()] +
    [("py_func", _centred)] + list(INSIDE_A_FUNCTION.items()) +
    list(SOFTMAX_OVER_THE_BATCH.items()) +
    [("cumsum_of_an_unknown_axis", lambda h: tf.cumsum(
        h, axis=tf.compat.v1.placeholder_with_default(0, [])))] +
    list(SLICING_ROWS.items()))


def _predicted(model_fn, towers):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(model_fn, towers, PREDICT)
    with tf.compat.v1.Session(config=session_config(4)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(spec.predictions["y"])


@pytest.mark.parametrize("name", sorted(REFUSED_ON_THE_LOSS_PATH))
def test_what_is_refused_on_the_loss_path_predicts_as_one_device(name):
  """Where no loss reads them (PREDICT), the ops the tests above refuse
  are computed once, on the whole batch's rows (issue 38 item 3): one
  device's predictions on 2 and 3 towers. They were refused on f65e512."""
  model_fn = _model_fn(REFUSED_ON_THE_LOSS_PATH[name])
  expected = _predicted(model_fn, None)
  assert expected.shape == (ROWS, 1)
  for towers in (2, 3):
    np.testing.assert_allclose(_predicted(model_fn, towers), expected,
                               rtol=1e-5, atol=1e-6)


def test_a_random_shuffle_of_the_rows_in_a_prediction_is_refused():
  """A stateful op where rows meet cannot be run again on the whole batch:
  refused, naming it and the fix."""
  shuffle = UNKNOWN["shuffle_of_the_rows"][0]
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match=(
        r"predictions\['y'\] is computed after ops where different rows "
        r"of the batch meet.*'RandomShuffle'.*stateful.*all_rows")):
      _build(_model_fn(shuffle), towers=2, mode=PREDICT)


def test_guarantees_md_counts_the_op_types_the_rule_knows():
  path = os.path.join(os.path.dirname(__file__), "..", "docs",
                      "guarantees.md")
  with open(path) as text:
    guarantees = text.read()
  assert "lists the {} op types known to keep rows apart".format(
      len(row_ops.KEEPS_ROWS_APART)) in guarantees
  assert "lists the {} op types with their patterns".format(
      len(row_rules.ROW_COMBINING)) in guarantees


def _keras_layers(hidden):
  """Ordinary Keras layers on the rows: none of their op types is refused."""
  tokens = tf.reshape(tf.tile(hidden, [1, 3]), [-1, 3, 4])
  ids = tf.cast(tf.abs(tokens[:, :, 0]) * 3.0, tf.int32) % 5
  tokens += tf.keras.layers.Embedding(5, 4)(ids)
  tokens = tf.keras.layers.Conv1D(4, 2, padding="same")(tokens)
  tokens = tf.keras.layers.LayerNormalization()(tokens)
  tokens += tf.keras.layers.MultiHeadAttention(2, 2)(tokens, tokens)
  tokens = tf.keras.layers.LSTM(4, return_sequences=True)(tokens)
  tokens = tf.keras.layers.Bidirectional(tf.keras.layers.GRU(2))(tokens)
  images = tf.reshape(tf.tile(hidden, [1, 4]), [-1, 4, 4, 1])
  images = tf.keras.layers.Conv2D(2, 3, padding="same")(images)
  images = tf.keras.layers.MaxPooling2D()(images)
  flat = tf.keras.layers.GlobalAveragePooling2D()(images)
  return tf.keras.layers.Dropout(0.0)(tf.concat([tokens, flat], 1))


@pytest.mark.parametrize("mode", [TRAIN, PREDICT])
def test_ordinary_keras_layers_are_not_refused(mode):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(_model_fn(_keras_layers), towers=2, mode=mode)
  assert spec.predictions is not None or spec.train_op is not None


@pytest.mark.parametrize("perm, axis, refused", [
    ([1, 0], 0, False), ([1, 0], 1, True), ([1, 0], -1, True),
    ([0, 1], 0, True)])
def test_rows_moved_by_a_transpose_are_followed(perm, axis, refused):
  def move(h):
    return tf.transpose(tf.reverse(tf.transpose(h, perm), [axis]), perm)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    if refused:
      with pytest.raises(ValueError, match=r"The ReverseV2 op '[^']+' "
                         r"combines different rows.*batch axis"):
        _build(_model_fn(move), towers=2)
    else:
      assert _build(_model_fn(move), towers=2, mode=PREDICT).predictions


def _tf1_layers(hidden):
  """Ordinary TF 1 code on the rows: none of its op types is refused."""
  steps = tf.reshape(tf.tile(hidden, [1, 3]), [-1, 3, 4])
  lengths = 1 + tf.cast(tf.abs(hidden[:, 0]) > 0.5, tf.int32)
  outputs, _ = tf.compat.v1.nn.bidirectional_dynamic_rnn(
      tf.compat.v1.nn.rnn_cell.LSTMCell(2, name="fw"),
      tf.compat.v1.nn.rnn_cell.GRUCell(2, name="bw"), steps,
      sequence_length=lengths, dtype=tf.float32)
  mask = tf.sequence_mask(lengths, 3, dtype=tf.float32)[:, :, None]
  pooled = tf.reduce_sum(tf.concat(outputs, 2) * mask, 1)
  normed = tf.compat.v1.layers.batch_normalization(hidden, training=True)
  images = tf.image.flip_left_right(tf.reshape(hidden, [-1, 2, 2, 1]))
  best = tf.nn.top_k(tf.nn.l2_normalize(hidden, 1), 2).values
  return tf.concat([pooled, normed, tf.reshape(images, [-1, 4]), best,
                    tf.one_hot(lengths, 2)], 1)


@pytest.mark.parametrize("mode", [TRAIN, PREDICT])
def test_ordinary_tf1_code_is_not_refused(mode):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _build(_model_fn(_tf1_layers), towers=2, mode=mode)
  assert spec.predictions is not None or spec.train_op is not None
