"""Check a model before training it on many devices: a tiny BERT-like
classifier (token embeddings, 2 self-attention layers with layer norm and
dropout, a pooled [CLS] row), compared on 2 towers with one device.

From this folder, the one command:

    python -m replicate.check check_demo:model_fn check_demo:input_fn

or `python check_demo.py`, which calls `replicate.check` and prints the
same table. Exit status 0: every variable, optimizer slot, the global step,
the loss of each step, every metric and every prediction equal one
device's, the towers fed one device's dropout draws.
"""

import sys

import numpy as np
import tensorflow as tf

import replicate

VOCABULARY, LENGTH, WIDTH, HEADS, LAYERS = 200, 16, 32, 4, 2
ROWS, BATCH = 96, 32


def input_fn():
  rng = np.random.RandomState(0)
  ids = rng.randint(1, VOCABULARY, (ROWS, LENGTH)).astype(np.int32)
  lengths = rng.randint(4, LENGTH + 1, ROWS)
  ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0  # padding
  labels = (ids[:, 1] % 2).astype(np.int64)
  return tf.data.Dataset.from_tensor_slices(({"ids": ids}, labels)).shuffle(
      ROWS, seed=0).batch(BATCH).repeat()


def _layer_norm(x, name):
  with tf.compat.v1.variable_scope(name):
    mean, variance = tf.nn.moments(x, [-1], keepdims=True)
    gamma = tf.compat.v1.get_variable("gamma", [WIDTH],
                                      initializer=tf.ones_initializer())
    beta = tf.compat.v1.get_variable("beta", [WIDTH],
                                     initializer=tf.zeros_initializer())
    return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


def _attention(x, mask, training):
  """Self-attention within each row: [rows, length, width]."""
  def heads(t):  # [rows, heads, length, width / heads]
    t = tf.reshape(t, [-1, LENGTH, HEADS, WIDTH // HEADS])
    return tf.transpose(t, [0, 2, 1, 3])
  # The key has no bias: its gradient is 0 in exact arithmetic (softmax
  # ignores a constant added to a query's scores), so under Adam it would
  # move by rounding noise alone, which no two summation orders share.
  query, key, value = (heads(tf.compat.v1.layers.dense(
      x, WIDTH, name=n, use_bias=n != "key")) for n in ("query", "key",
                                                        "value"))
  scores = tf.matmul(query, key, transpose_b=True) / np.sqrt(WIDTH // HEADS)
  scores += (1.0 - mask[:, None, None, :]) * -10000.0
  weights = tf.compat.v1.layers.dropout(tf.nn.softmax(scores), 0.1,
                                        training=training)
  context = tf.transpose(tf.matmul(weights, value), [0, 2, 1, 3])
  return tf.reshape(context, [-1, LENGTH, WIDTH])


def model_fn(features, labels, mode):
  training = mode == tf.estimator.ModeKeys.TRAIN
  ids = features["ids"]
  mask = tf.cast(tf.not_equal(ids, 0), tf.float32)
  embeddings = tf.compat.v1.get_variable(
      "embeddings", [VOCABULARY, WIDTH],
      initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.02))
  x = _layer_norm(tf.gather(embeddings, ids), "embeddings_norm")
  for layer in range(LAYERS):
    with tf.compat.v1.variable_scope("layer_{}".format(layer)):
      attended = _attention(x, mask, training)
      x = _layer_norm(x + tf.compat.v1.layers.dropout(
          attended, 0.1, training=training), "attention_norm")
      inner = tf.compat.v1.layers.dense(x, 2 * WIDTH, tf.nn.gelu,
                                        name="intermediate")
      x = _layer_norm(x + tf.compat.v1.layers.dense(inner, WIDTH,
                                                    name="output"),
                      "output_norm")
  pooled = tf.compat.v1.layers.dense(x[:, 0], WIDTH, tf.tanh, name="pooler")
  logits = tf.compat.v1.layers.dense(pooled, 2, name="classifier")
  predictions = {"class": tf.argmax(logits, 1),
                 "probabilities": tf.nn.softmax(logits)}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(1e-3))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, eval_metric_ops={
          "accuracy": tf.compat.v1.metrics.accuracy(labels,
                                                    predictions["class"])})


if __name__ == "__main__":
  report = replicate.check(model_fn, input_fn, towers=(2,), steps=3)
  print(report)
  sys.exit(0 if report.exact else 1)
