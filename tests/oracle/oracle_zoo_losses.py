"""The zoo's models whose loss is a value over the batch.

Written as their authors write them, for one device: each
`tf.compat.v1.losses` reduction with a `weights` column holding zeros;
Keras losses with `sample_weight`, each reduction a `model_fn` may use; a
total loss of terms with different denominators (a padded token mean, a
row-mean auxiliary loss, L2 regularization) from `get_total_loss()`; and
tensorflow/nmt's step (a token sum over the batch size, `tf.gradients`,
an active `clip_by_global_norm`, `apply_gradients`). None states its
denominator (`replicate.loss_denominator`): the wrapper reads it from the
graph.

`ENTRIES` holds `oracle_zoo._custom`'s arguments, one dict a model; the zoo
registers them (this module imports nothing of the zoo, so either imports
first). Each names the factors its cells take (`only`): the pipeline of
uneven shards ("batch": 3 + 3 + 1 rows, the last batch leaving towers
without rows), of a known batch size ("drop_remainder"), and the modes
that read the loss.
"""

import numpy as np
import tensorflow as tf

import replicate

ROWS = 7
ModeKeys = tf.estimator.ModeKeys
Reduction = tf.compat.v1.losses.Reduction
KerasReduction = tf.keras.losses.Reduction
VOCAB = 6
LOSS_MODES = ("train", "eval")
MANY_TOWERS = ("2", "3", "3_small")
# Rows 1, 4 and 6 weigh 0: 3 towers on the first batch of 3 give one a row
# of weight 0 alone, "3_small" too (rows 0 and 1), and the remainder batch
# (row 6) weighs 0 in all.
ROW_WEIGHTS = np.array([1.0, 0.0, 1.0, 2.0, 0.0, 0.5, 0.0], np.float32)


def _fixed(shape, dtype=tf.float32):
  return tf.io.FixedLenFeature(shape, dtype)


def _classifier(features):
  hidden = tf.compat.v1.layers.dense(features["x"], 6, activation=tf.nn.relu,
                                     name="hidden")
  return tf.compat.v1.layers.dense(hidden, 3, name="logits")


def _classifier_spec(mode, labels, logits, loss, weights):
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, axis=1), weights=weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def v1_weighted_loss_model_fn(features, labels, mode, params):
  """`tf.compat.v1.losses` with a weight column, `params["reduction"]`."""
  logits = _classifier(features)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "class_ids": tf.argmax(logits, axis=1)})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, weights=features["weight"],
      reduction=params["reduction"])
  return _classifier_spec(mode, labels, logits, loss, features["weight"])


def keras_sample_weight_model_fn(features, labels, mode, params):
  """A Keras loss object called with `sample_weight`; with
  `Reduction.NONE` the user averages the per-row values."""
  logits = _classifier(features)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "class_ids": tf.argmax(logits, axis=1)})
  loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=params["reduction"])
  loss = loss_object(labels, logits, sample_weight=features["weight"])
  if params["reduction"] == KerasReduction.NONE:
    loss = tf.reduce_mean(loss)
  return _classifier_spec(mode, labels, logits, loss, features["weight"])


def _weighted_data(seed):
  rng = np.random.RandomState(seed)
  return ({"x": rng.randn(ROWS, 3).astype(np.float32),
           "weight": ROW_WEIGHTS.copy()},
          rng.randint(0, 3, ROWS).astype(np.int64))


_WEIGHTED_SPEC = {"x": _fixed([3]), "weight": _fixed([]),
                  "label": _fixed([], tf.int64)}


# ---------------------------------------------------------------------------
# Token models: 5 tokens a row, 0 is padding; row 1 is all padding (alone
# on its tower with 3 towers on the first batch, and with "3_small").


def token_logits(tokens):
  embedding = tf.compat.v1.get_variable(
      "embedding", [VOCAB, 4],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5))
  hidden = tf.nn.embedding_lookup(embedding, tokens)
  return hidden, tf.compat.v1.layers.dense(hidden, VOCAB, name="presoftmax")


def token_xent(logits, labels):
  """The padded token cross entropy, and the mask of real tokens."""
  weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
  xentropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                            logits=logits)
  return xentropy * weights, weights


def multi_term_model_fn(features, labels, mode):
  """A translation loss with an auxiliary length regression and L2 on the
  projection: `add_loss`, a `tf.compat.v1.losses` term and a regularizer,
  summed by `get_total_loss()`."""
  hidden, logits = token_logits(features["tokens"])
  pooled = tf.reduce_mean(hidden, axis=1)
  length = tf.compat.v1.layers.dense(
      pooled, 1, name="length",
      kernel_regularizer=tf.keras.regularizers.l2(0.05))
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "outputs": tf.argmax(logits, axis=-1), "length": length})
  xentropy, weights = token_xent(logits, labels)
  tf.compat.v1.losses.add_loss(tf.reduce_sum(xentropy) /
                               tf.reduce_sum(weights))
  tf.compat.v1.losses.mean_squared_error(features["length"], length,
                                         weights=0.5)
  loss = tf.compat.v1.losses.get_total_loss()
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "total_loss": tf.compat.v1.metrics.mean(loss)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


NMT_CLIP_NORM = 0.5


def nmt_model_fn(features, labels, mode):
  """tensorflow/nmt's training step: the token loss summed and divided by
  the batch size (`tf.size` of the source lengths), `tf.gradients`, then
  `clip_by_global_norm` and the optimizer's `apply_gradients`."""
  source_length = tf.reduce_sum(tf.cast(tf.not_equal(features["tokens"], 0),
                                        tf.int32), axis=1)
  batch_size = tf.size(source_length)
  _, logits = token_logits(features["tokens"])
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "outputs": tf.argmax(logits, axis=-1)})
  crossent, target_weights = token_xent(logits, labels)
  loss = tf.reduce_sum(crossent * target_weights) / tf.cast(batch_size,
                                                             tf.float32)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  params = tf.compat.v1.trainable_variables()
  gradients = tf.compat.v1.gradients(loss, params,
                                     colocate_gradients_with_ops=True)
  clipped_gradients, _ = tf.clip_by_global_norm(gradients, NMT_CLIP_NORM)
  opt = replicate.TowerOptimizer(tf.compat.v1.train.GradientDescentOptimizer(
      1.0))
  train_op = opt.apply_gradients(
      zip(clipped_gradients, params),
      global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _token_data(seed):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, VOCAB, (ROWS, 5)).astype(np.int64)
  for row, kept in enumerate([3, 0, 5, 2, 4, 1, 5]):  # row 1: all padding
    tokens[row, kept:] = 0
  targets = (tokens * 2 + 1) % VOCAB
  targets[tokens == 0] = 0
  return tokens, targets.astype(np.int64)


def tokens_and_targets(seed):
  tokens, targets = _token_data(seed)
  return {"tokens": tokens}, targets


def _multi_term_data():
  tokens, targets = _token_data(21)
  length = (tokens != 0).sum(axis=1, keepdims=True).astype(np.float32) / 5
  return {"tokens": tokens, "length": length}, targets


TOKEN_SPEC = {"tokens": _fixed([5], tf.int64), "label": _fixed([5], tf.int64)}


def _entries():
  entries = []
  # SUM_OVER_NONZERO_WEIGHTS is SUM_BY_NONZERO_WEIGHTS (the same string).
  assert Reduction.SUM_OVER_NONZERO_WEIGHTS == Reduction.SUM_BY_NONZERO_WEIGHTS
  for reduction in (Reduction.SUM_BY_NONZERO_WEIGHTS, Reduction.MEAN,
                    Reduction.SUM_OVER_BATCH_SIZE, Reduction.SUM):
    # The default reduction, the row, with a known batch size too
    # and on "replicated"; the others, whose towers combine the same way,
    # on "batch" and parameter_server.
    default = reduction == Reduction.SUM_BY_NONZERO_WEIGHTS
    entries.append(dict(
        name="v1_losses_weights_" + reduction.replace("weighted_", ""),
        model_fn=v1_weighted_loss_model_fn, data=_weighted_data(22),
        example_spec=_WEIGHTED_SPEC, serving_keys=["x", "weight"],
        params={"reduction": reduction},
        only={"pipeline": ("batch",) + (
                  ("drop_remainder",) if default else ()),
              "towers": MANY_TOWERS,
              "strategy": ("parameter_server",) + (
                  ("replicated",) if default else ()),
              "mode": LOSS_MODES}))
  # AUTO is SUM_OVER_BATCH_SIZE outside a distribution strategy; NONE
  # leaves one value a row, which the model_fn averages.
  for reduction in (KerasReduction.AUTO, KerasReduction.SUM_OVER_BATCH_SIZE,
                    KerasReduction.SUM, KerasReduction.NONE):
    entries.append(dict(
        name="keras_loss_sample_weight_" + reduction,
        model_fn=keras_sample_weight_model_fn, data=_weighted_data(23),
        example_spec=_WEIGHTED_SPEC, serving_keys=["x", "weight"],
        params={"reduction": reduction},
        only={"pipeline": ("batch",), "towers": MANY_TOWERS,
              "strategy": ("parameter_server",), "mode": LOSS_MODES}))
  entries.append(dict(
      name="terms_of_different_denominators", model_fn=multi_term_model_fn,
      data=_multi_term_data(),
      example_spec=dict(TOKEN_SPEC, length=_fixed([1])),
      serving_keys=["tokens"],
      only={"pipeline": ("batch", "drop_remainder"), "towers": MANY_TOWERS,
            "strategy": ("parameter_server", "replicated"),
            "mode": LOSS_MODES}))
  entries.append(dict(
      name="nmt_clip_after_tf_gradients", model_fn=nmt_model_fn,
      data=tokens_and_targets(26), example_spec=TOKEN_SPEC,
      serving_keys=["tokens"],
      only={"pipeline": ("batch",), "towers": MANY_TOWERS,
            "strategy": ("parameter_server", "round_robin"),
            "mode": ("train",)}))
  return entries


ENTRIES = _entries()
