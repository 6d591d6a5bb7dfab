"""The zoo's models whose metrics are fed values over the batch.

Written as their authors write them, for one device:
`tf.compat.v1.metrics.mean(loss)` of a padded token loss (as it is,
weighted by the batch's token count, and the batch's longest target), and a
corpus score through `py_func` in a `TPUEstimatorSpec`'s `eval_metrics`, as
google-research/bert's and tensorflow/models' Transformer's `model_fn`s
feed it, and the same score in plain `eval_metric_ops` on batches of
unknown and known size alike; a
tf_ner-style tagger whose `tf.sequence_mask(nwords)` weighs its loss and
metrics, which feed TRAIN summaries.

`ENTRIES`: `oracle_zoo._custom`'s arguments, as in oracle_zoo_losses.py,
whose token model and data these share; on "batch" (3 + 3 + 1 rows) and
"from_tensors" (7 rows: 4 + 3 and 3 + 2 + 2), uneven shards both.
"""

import numpy as np
import tensorflow as tf

import replicate
from oracle_zoo_losses import (LOSS_MODES, MANY_TOWERS, TOKEN_SPEC, ModeKeys,
                               token_logits, token_xent, tokens_and_targets)


def mean_of_loss_model_fn(features, labels, mode):
  """A seq2seq loss over the real tokens (`weights=` the target mask, the
  default SUM_BY_NONZERO_WEIGHTS), its value a metric in EVAL: as it is,
  weighted by the batch's token count, and the batch's longest target."""
  _, logits = token_logits(features["tokens"])
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "outputs": tf.argmax(logits, axis=-1)})
  weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                          weights=weights)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "eval_loss": tf.compat.v1.metrics.mean(loss),
        "loss_per_token": tf.compat.v1.metrics.mean(
            loss, weights=tf.reduce_sum(weights)),
        "longest_target": tf.compat.v1.metrics.mean(
            tf.reduce_max(tf.reduce_sum(weights, axis=1))),
        "token_accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, axis=-1), weights=weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def corpus_score(predicted, reference):
  """A BLEU-like score of a whole batch: clipped 1- and 2-gram matches over
  every row, divided by every row's n-gram count, times a brevity penalty.
  Padding (0) is not a token. Not a mean of per-row values."""
  matches, totals, length, reference_length = [0, 0], [0, 0], 0, 0
  for guess, truth in zip(predicted.tolist(), reference.tolist()):
    guess = [token for token in guess if token]
    truth = [token for token in truth if token]
    length, reference_length = length + len(guess), reference_length + len(
        truth)
    for n in (1, 2):
      grams = [tuple(guess[i:i + n]) for i in range(len(guess) - n + 1)]
      wanted = [tuple(truth[i:i + n]) for i in range(len(truth) - n + 1)]
      totals[n - 1] += len(grams)
      matches[n - 1] += sum(min(grams.count(g), wanted.count(g))
                            for g in set(grams))
  if not all(totals) or not length:
    return np.float32(0.0)
  precision = np.exp(np.mean(np.log([(m + 1.0) / (t + 1.0)
                                     for m, t in zip(matches, totals)])))
  brevity = min(1.0, np.exp(1.0 - reference_length / length))
  return np.float32(precision * brevity)


def corpus_metric_fn(logits, labels):
  """The metric_fn of the TPUEstimatorSpec: the score of the batch."""
  predicted = tf.argmax(logits, axis=-1) * tf.cast(tf.not_equal(labels, 0),
                                                   tf.int64)
  score = tf.compat.v1.py_func(corpus_score, [predicted, labels], tf.float32,
                               stateful=False)
  return {"approx_bleu_score": tf.compat.v1.metrics.mean(score)}


def corpus_metric_model_fn(features, labels, mode, params):
  """BERT's and the Transformer's shape: a TPUEstimatorSpec (run with
  use_tpu=False) whose eval_metrics computes a corpus score."""
  del params  # TPUEstimator's batch_size and the like
  _, logits = token_logits(features["tokens"])
  if mode == ModeKeys.PREDICT:
    return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
        mode, predictions={"outputs": tf.argmax(logits, axis=-1)})
  xentropy, weights = token_xent(logits, labels)
  loss = tf.reduce_sum(xentropy) / tf.reduce_sum(weights)
  if mode == ModeKeys.EVAL:
    return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss, eval_metrics=(corpus_metric_fn, [logits, labels]))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(mode, loss=loss,
                                                     train_op=train_op)


def plain_corpus_metric_model_fn(features, labels, mode):
  """corpus_metric_tpu_spec's model as an Estimator user writes it: the
  metric_fn's metrics returned as `eval_metric_ops`. The score is computed
  once on the whole batch's rows, on batches of unknown size (an
  input_fn's `.batch()`) and of known size (`from_tensors`) alike."""
  _, logits = token_logits(features["tokens"])
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "outputs": tf.argmax(logits, axis=-1)})
  xentropy, weights = token_xent(logits, labels)
  loss = tf.reduce_sum(xentropy) / tf.reduce_sum(weights)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, eval_metric_ops=corpus_metric_fn(logits, labels))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def sequence_mask_tagger_model_fn(features, labels, mode):
  """guillaumegenthial/tf_ner's tagger, as written: the tokens' lengths
  counted, `tf.sequence_mask(nwords)` (the batch's longest, no maxlen) as
  the loss's and the metrics' weights, and in TRAIN a summary of every
  metric's update."""
  tokens = features["tokens"]
  nwords = tf.reduce_sum(tf.cast(tf.not_equal(tokens, 0), tf.int32), axis=1)
  _, logits = token_logits(tokens)
  pred_ids = tf.argmax(logits, axis=-1)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"tags": pred_ids})
  # Tokens are padded at the end: the first nwords of a row are its own.
  mask = tf.sequence_mask(nwords)
  width = tf.shape(mask)[1]
  tags, logits, pred_ids = (labels[:, :width], logits[:, :width],
                            pred_ids[:, :width])
  xentropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tags,
                                                            logits=logits)
  loss = tf.reduce_mean(tf.boolean_mask(xentropy, mask))
  weights = tf.sequence_mask(nwords)
  metrics = {
      "acc": tf.compat.v1.metrics.accuracy(tags, pred_ids, weights),
      "fill": tf.compat.v1.metrics.mean(
          tf.cast(nwords, tf.float32) /
          tf.cast(tf.maximum(tf.reduce_max(nwords), 1), tf.float32))}
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops=metrics)
  for name, (_, update) in metrics.items():
    tf.compat.v1.summary.scalar(name, update)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def as_tpu_estimator_on_cpu(model_fn):
  """`model_fn`, its TPUEstimatorSpec converted as TPUEstimator(use_tpu=
  False) converts it on CPU: the oracle's run (Estimator refuses one)."""
  def converted(features, labels, mode, params):
    return model_fn(features, labels, mode, params).as_estimator_spec()
  return converted


ENTRIES = [
    dict(name="metrics_mean_of_loss", model_fn=mean_of_loss_model_fn,
         data=tokens_and_targets(24), example_spec=TOKEN_SPEC,
         serving_keys=["tokens"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server",), "mode": LOSS_MODES}),
    dict(name="corpus_metric_tpu_spec", model_fn=corpus_metric_model_fn,
         unwrapped_model_fn=as_tpu_estimator_on_cpu(corpus_metric_model_fn),
         data=tokens_and_targets(25), example_spec=TOKEN_SPEC,
         serving_keys=["tokens"], params={},
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated"),
               "mode": LOSS_MODES}),
    dict(name="corpus_metric_eval_metric_ops",
         model_fn=plain_corpus_metric_model_fn,
         data=tokens_and_targets(25), example_spec=TOKEN_SPEC,
         serving_keys=["tokens"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated"),
               "mode": LOSS_MODES}),
    dict(name="sequence_mask_tagger", model_fn=sequence_mask_tagger_model_fn,
         data=tokens_and_targets(26), example_spec=TOKEN_SPEC,
         serving_keys=["tokens"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated"),
               "mode": LOSS_MODES}),
]
