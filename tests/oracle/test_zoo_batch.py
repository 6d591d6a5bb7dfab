"""The zoo's batch-level models as written for one device, where no exact
form exists without the fix: refused, naming the op and the fix.

The zoo (oracle_zoo_metrics.py, oracle_zoo_rows.py) holds the exact forms,
each exact in its cells: the corpus score in a `TPUEstimatorSpec`'s
`eval_metrics` and in plain `eval_metric_ops`, in-batch negatives through
`replicate.all_rows`. Here the negatives of the tower's own rows, as a user
first writes them.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import oracle_zoo  # registers the modules below into the zoo
import oracle_zoo_losses as losses
import oracle_zoo_metrics as metrics
import oracle_zoo_rows as rows
import replicate

ModeKeys = tf.estimator.ModeKeys


def _devices(count):
  return ["/cpu:{}".format(index) for index in range(count)]


def _build(model_fn, mode, features, labels, towers=2, params=None):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    wrapped = replicate.replicate_model_fn(model_fn, devices=_devices(towers))
    kwargs = {} if params is None else {"params": params}
    return wrapped(features=tf.nest.map_structure(tf.constant, features),
                   labels=None if labels is None else tf.constant(labels),
                   mode=mode, **kwargs)


def test_the_corpus_score_is_not_a_mean_of_the_towers_scores():
  """Why the score is computed again on the whole batch's rows: on the
  zoo's first batch split 2 + 1 (2 towers), the towers' scores do not
  average to the batch's."""
  _, targets = oracle_zoo.ZOO["corpus_metric_tpu_spec"].data
  guess = (targets + 1) % losses.VOCAB * (targets != 0)
  batch = metrics.corpus_score(guess[:3], targets[:3])
  towers = [metrics.corpus_score(guess[:2], targets[:2]),
            metrics.corpus_score(guess[2:3], targets[2:3])]
  assert abs(batch - np.mean(towers)) > 1e-3, (batch, towers)


@pytest.mark.parametrize("mode", [ModeKeys.TRAIN, ModeKeys.EVAL])
def test_in_batch_negatives_without_all_rows_are_refused(mode):
  """On the loss's path. (In PREDICT they are computed on the whole
  batch's rows: tests/test_all_rows.py.)"""
  features, _ = oracle_zoo.ZOO["in_batch_negatives_all_rows"].data
  with pytest.raises(ValueError, match=r"MatMul.*replicate\.all_rows"):
    _build(rows.retrieval_model_fn, mode, features, None,
           params={"all_rows": False})


def _shards(count, towers):
  """Each tower's rows of a batch of `count`, as replicate splits it."""
  sizes = [count // towers + (index < count % towers)
           for index in range(towers)]
  starts = np.cumsum([0] + sizes)
  return [slice(start, start + size) for start, size in zip(starts, sizes)]


def test_the_sequences_batches_are_as_wide_as_their_towers_are_not():
  """The tagger's and the decoder's data (oracle_zoo_rows.LENGTHS): every
  batch of their cells is 5 wide, so one device's predictions stack across
  batches, and on 2 and 3 towers some tower's own rows are narrower."""
  lengths = rows.LENGTHS
  batches = [(0, 3), (3, 6), (6, 7), (0, 7), (0, 2)]  # batch, all, 3_small
  assert {lengths[a:b].max() for a, b in batches[:4]} == {5}
  narrower = 0
  for (start, stop), towers in itertools.product(batches, (2, 3)):
    widths = [lengths[start:stop][shard].max()
              for shard in _shards(stop - start, towers)
              if shard.stop > shard.start]
    narrower += min(widths) < lengths[start:stop].max()
  assert narrower >= 5, narrower


def mirrored_negatives_model_fn(features, labels, mode):
  """Retrieval with one negative a query, as a one-device author writes
  it: the document of the batch's mirrored row, by `tf.gather` of a
  reversed `tf.range` (what `tf.reverse(document, [0])` does)."""
  del labels
  query = rows._tower(features["query"], "query")  # pylint: disable=W0212
  document = rows._tower(features["document"], "document")  # noqa
  count = tf.shape(document)[0]
  negative = tf.gather(document, tf.range(count - 1, -1, -1))
  margin = tf.reduce_sum(query * (negative - document), axis=1)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"margin": margin})
  loss = tf.reduce_mean(tf.nn.relu(margin + 0.5))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("mode", [ModeKeys.TRAIN, ModeKeys.EVAL])
def test_rows_reversed_by_a_gather_are_refused(mode):
  """On 6b12641 this passed as "layout": each tower mirrored its own rows
  (predictions 0.36 / 0.45 off on 2 / 3 towers in the issue's repro). In
  PREDICT the predictions are computed on the whole batch's rows
  (tests/test_batch_predictions.py)."""
  features, _ = oracle_zoo.ZOO["in_batch_negatives_all_rows"].data
  with pytest.raises(ValueError, match=(
      r"The GatherV2 op '[^']+' combines different rows of the batch \(it "
      r"takes rows by indices that are not each row's own position.*"
      r"replicate\.all_rows.*replicate\.row_offset\(\)")):
    _build(mirrored_negatives_model_fn, mode, features, None)
