"""Tiny models for tests/test_check.py: exact ones, and ones with a planted
difference (each line that plants one says so, for the source-line test)."""

import numpy as np
import tensorflow as tf

import replicate

ROWS, BATCH = 14, 7  # 7 rows a batch: 4 + 3 on 2 towers
X = np.random.RandomState(0).rand(ROWS, 4).astype(np.float32)
Y = (X.sum(axis=1) > 2).astype(np.int64)


def input_fn():
  return tf.data.Dataset.from_tensor_slices(({"x": X}, Y)).batch(BATCH)


def _spec(mode, hidden, labels, extra_metrics=None, loss=None):
  logits = tf.compat.v1.layers.dense(hidden, 2)
  predictions = {"class": tf.argmax(logits, 1),
                 "probabilities": tf.nn.softmax(logits)}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  if loss is None:
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  else:
    loss = loss(labels, logits)
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.1))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  metrics = {"accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                       predictions["class"])}
  metrics.update(extra_metrics or {})
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    eval_metric_ops=metrics)


def plain(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  return _spec(mode, hidden, labels)


def with_dropout(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  hidden = tf.compat.v1.layers.dropout(
      hidden, 0.5, training=mode == tf.estimator.ModeKeys.TRAIN)
  return _spec(mode, hidden, labels)


def with_dropout_summarized(features, labels, mode):
  # A metric's update after a dropout, written as a TRAIN summary, as
  # tf_ner writes its metrics'.
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  hidden = tf.compat.v1.layers.dropout(
      hidden, 0.5, training=mode == tf.estimator.ModeKeys.TRAIN)
  spec = _spec(mode, hidden, labels)
  if mode == tf.estimator.ModeKeys.TRAIN:
    tf.compat.v1.summary.scalar("accuracy",
                                spec.eval_metric_ops["accuracy"][1])
  return spec


def with_dropout_after_padding_removal(features, labels, mode):
  # tensorflow/models' Transformer FFN: the tokens that are not padding
  # (x < 0.3 here) gathered into one [1, tokens, d] sequence, a dropout on
  # it (a draw of that shape: tower i's tokens are the ones after towers
  # 0..i-1's in one device's), scattered back to their positions.
  x = features["x"]
  rows, length = tf.shape(x)[0], tf.shape(x)[1]
  hidden = tf.compat.v1.layers.dense(x[:, :, None], 3, name="embed")
  kept = tf.cast(tf.where(tf.reshape(x, [-1]) >= 0.3), tf.int32)
  tokens = tf.expand_dims(tf.gather_nd(tf.reshape(hidden, [-1, 3]), kept), 0)
  tokens = tf.compat.v1.layers.dense(tokens, 5, tf.nn.relu, name="filter")
  tokens = tf.compat.v1.layers.dropout(
      tokens, 0.5, training=mode == tf.estimator.ModeKeys.TRAIN)
  tokens = tf.compat.v1.layers.dense(tokens, 3, name="output")
  back = tf.scatter_nd(kept, tf.squeeze(tokens, 0), [rows * length, 3])
  return _spec(mode, tf.reshape(back, [rows, length * 3]), labels)


def with_dropout_per_item(features, labels, mode):
  # Each row's 2 items through one layer, as a ranking model scores a
  # list's items: flattened to [rows * 2, 2], so the dropout draws 2
  # entries per row.
  items = tf.reshape(features["x"], [-1, 2])
  hidden = tf.compat.v1.layers.dense(items, 8, tf.nn.relu)
  hidden = tf.compat.v1.layers.dropout(
      hidden, 0.5, training=mode == tf.estimator.ModeKeys.TRAIN)
  return _spec(mode, tf.reshape(hidden, [-1, 16]), labels)


def _doubled(x):
  return (2 * x).astype(np.float32)  # row by row: keeps rows apart


def _minus_first_row(x):
  return (x - x[:1]).astype(np.float32)  # mixes rows: row 0 into each


def _py_func(fn, x):
  out = tf.compat.v1.py_func(fn, [x], tf.float32, stateful=False)
  out.set_shape(x.shape)
  return out


def declared_right(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  hidden = _py_func(_doubled, hidden)
  replicate.rows_apart(hidden)
  return _spec(mode, hidden, labels)


def undeclared(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  hidden = _py_func(_doubled, hidden)
  return _spec(mode, hidden, labels)


def declared_wrong(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  mixed = tf.compat.v1.py_func(_minus_first_row, [hidden], tf.float32, False)
  mixed.set_shape([None, 8])  # the line above is PLANTED: it mixes rows
  hidden = mixed
  replicate.rows_apart(hidden)
  return _spec(mode, hidden, labels)


def declared_wrong_after_positions(features, labels, mode):
  # Each row's last relevant entry, by index tuples of its own position
  # (`tf.range(rows)`: a tower's are its own shard's, 0 to n_i - 1), then
  # the wrong declaration.
  x = features["x"]
  lengths = 1 + tf.cast(x[:, 0] * 3, tf.int32)
  last = tf.gather_nd(tf.expand_dims(x, -1), tf.stack(
      [tf.range(tf.shape(x)[0]), lengths - 1], 1))
  joined = tf.compat.v1.layers.dense(tf.concat([x, last], 1), 8, tf.nn.relu)
  mixed = tf.compat.v1.py_func(_minus_first_row, [joined], tf.float32, False)
  mixed.set_shape([None, 8])  # the line above is PLANTED: it mixes rows
  replicate.rows_apart(mixed)
  return _spec(mode, mixed, labels)


def max_metric(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  scores = tf.reduce_sum(hidden, axis=1)
  scaled = scores / tf.reduce_max(scores)  # PLANTED: the tower's max
  return _spec(mode, hidden, labels, extra_metrics={
      "scaled": tf.compat.v1.metrics.mean(scaled)})


def reversed_rows(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  rows = tf.shape(hidden)[0]
  hidden = tf.gather(hidden, tf.range(rows - 1, -1, -1))  # PLANTED: reverse
  return _spec(mode, hidden, labels)


def wrong_denominator(features, labels, mode):
  def loss(labels, logits):
    per_row = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    count = tf.cast(tf.shape(per_row)[0], tf.float32)
    replicate.loss_denominator(tf.sqrt(count))  # PLANTED: not the count
    return tf.reduce_sum(per_row) / count
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  return _spec(mode, hidden, labels, loss=loss)


def fixed_batch(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu)
  rows = tf.debugging.assert_equal(tf.shape(hidden)[0], BATCH)  # PLANTED
  with tf.control_dependencies([rows]):
    hidden = tf.identity(hidden)
  return _spec(mode, hidden, labels)
