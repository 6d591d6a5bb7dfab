"""Metric updates fed a value over the batch get the whole batch's value.

`metrics.mean(loss)`, `metrics.mean(tf.reduce_max(x))`: on 2c8ec8c each tower
fed its own shard's value and the towers' were averaged (on uneven shards,
a mean of tower means). Now tower 0's update is fed the whole batch's value,
once; a value that no combination gives (a py_func corpus score, a median)
is computed once on the whole batch's rows; so is the TPUEstimatorSpec
form (tests/test_tpu_spec.py).
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, cpus, session_config

metrics = tf.compat.v1.metrics
tpu = tf.compat.v1.estimator.tpu

_rng = np.random.RandomState(4)
X = _rng.randn(9, 3).astype(np.float32)
Y = _rng.randn(9, 1).astype(np.float32)
W = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0], np.float32).reshape(9, 1)
KERNEL = _rng.randn(3, 1).astype(np.float32)


def _model_fn(metric_fn):
  def model_fn(features, labels, mode):
    predictions = tf.compat.v1.layers.dense(
        features["x"], 1, name="dense",
        kernel_initializer=tf.compat.v1.constant_initializer(KERNEL))
    squared = tf.square(predictions - labels)
    loss = tf.reduce_mean(squared)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, predictions=predictions,
        eval_metric_ops=metric_fn(features, loss, squared, predictions))
  return model_fn


def _mean_of_loss(features, loss, squared, predictions):
  del features, squared, predictions
  return {"loss_mean": metrics.mean(loss)}


def _max_min_sum(features, loss, squared, predictions):
  del loss, predictions
  x = features["x"]
  return {"max": metrics.mean(tf.reduce_max(x)),
          "min": metrics.mean(tf.reduce_min(squared)),
          "sum": metrics.mean(tf.reduce_sum(x)),
          "column_means": metrics.mean_tensor(tf.reduce_mean(x, axis=0))}


def _weighted_token_mean(features, loss, squared, predictions):
  """A padded mean (sum / sum of weights) that is not the spec's loss."""
  del loss, predictions
  weights = features["w"]
  value = tf.reduce_sum(squared * weights) / tf.reduce_sum(weights)
  return {"token_mean": metrics.mean(value),
          "per_row": metrics.mean(squared, weights=weights),
          "mae": metrics.mean_absolute_error(features["y"],
                                             features["y"] * 0.5)}


def _counted_per_row(features, loss, squared, predictions):
  """Per-row metrics whose writes scatter or sum rows of unknown rank:
  sums over the rows, summed over towers, never refused (both were)."""
  del loss, squared
  labels = tf.cast(features["y"][:, 0] > 0, tf.int64)
  scores = tf.concat([-predictions, predictions], axis=1)
  return {"mean_iou": metrics.mean_iou(labels, tf.argmax(scores, 1), 2),
          "precision_at_1": metrics.precision_at_k(labels, scores, 1)}


METRIC_FNS = {"mean_of_loss": _mean_of_loss, "max_min_sum": _max_min_sum,
              "weighted_token_mean": _weighted_token_mean,
              "counted_per_row": _counted_per_row}


def _evaluated(model_fn, batches, static):
  """Every metric after the update ran once per batch (lists of row counts)."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    if static:
      assert len(batches) == 1
      rows = batches[0]
      feeds = [{}]
      features = {"x": tf.constant(X[:rows]), "w": tf.constant(W[:rows]),
                  "y": tf.constant(Y[:rows])}
      labels = tf.constant(Y[:rows])
    else:
      features = {"x": tf.compat.v1.placeholder(tf.float32, [None, 3]),
                  "w": tf.compat.v1.placeholder(tf.float32, [None, 1]),
                  "y": tf.compat.v1.placeholder(tf.float32, [None, 1])}
      labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
      feeds, start = [], 0
      for rows in batches:
        part = slice(start, start + rows)
        feeds.append({features["x"]: X[part], features["w"]: W[part],
                      features["y"]: Y[part], labels: Y[part]})
        start += rows
    spec = model_fn(features=features, labels=labels, mode=EVAL)
    updates = [u for _, u in spec.eval_metric_ops.values()]
    values = {k: v for k, (v, _) in spec.eval_metric_ops.items()}
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      for feed in feeds:
        session.run(updates, feed)
      return session.run(values)


CASES = [(2, [5], True), (3, [7], True), (2, [5, 4], False),
         (3, [7, 2], False), (3, [2], True)]


@pytest.mark.parametrize("name", sorted(METRIC_FNS))
@pytest.mark.parametrize("towers,batches,static", CASES)
def test_metric_fed_a_value_over_the_batch_is_one_devices(
    name, towers, batches, static):
  model_fn = _model_fn(METRIC_FNS[name])
  expected = _evaluated(model_fn, batches, static)
  got = _evaluated(replicate.replicate_model_fn(model_fn,
                                                devices=cpus(towers)),
                   batches, static)
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7,
                               err_msg=key)


def test_mean_of_loss_on_uneven_shards_is_not_the_mean_of_tower_means():
  """The numbers of the issue's row: 5 rows on 2 towers, 7 on 3."""
  model_fn = _model_fn(_mean_of_loss)
  for towers, rows in ((2, 5), (3, 7)):
    expected = _evaluated(model_fn, [rows], True)["loss_mean"]
    predictions = X[:rows] @ KERNEL
    squared = (predictions - Y[:rows]) ** 2
    assert expected == pytest.approx(squared.mean(), rel=1e-6)
    tower_means = np.mean([s.mean() for s in np.array_split(squared, towers)])
    assert abs(tower_means - expected) > 1e-3 * expected  # what 2c8ec8c gave
    got = _evaluated(replicate.replicate_model_fn(model_fn,
                                                  devices=cpus(towers)),
                     [rows], True)["loss_mean"]
    assert got == pytest.approx(expected, rel=1e-6)


def _corpus(features, loss, squared, predictions):
  del features, loss, squared
  score = tf.compat.v1.py_func(
      lambda p: np.float32(np.median(p) + p[0, 0] - p[-1, 0]),
      [predictions], tf.float32, stateful=False)
  return {"corpus": metrics.mean(score)}


def _corpus_weighted(features, loss, squared, predictions):
  """The Transformer's form (tensorflow/models' metrics.py): a corpus score
  whose `metrics.mean` is given `weights=tf.constant(1.0)`, so that the
  count is a sum of weights broadcast to the score's unknown shape, over
  the axes `tf.range(tf.rank(score))`."""
  del features, loss, squared
  score = tf.compat.v1.py_func(
      lambda p: np.float32(np.median(p) + p[0, 0] - p[-1, 0]),
      [predictions], tf.float32, stateful=False)
  return {"corpus": metrics.mean(score, tf.constant(1.0))}


def _median(features, loss, squared, predictions):
  del features, loss, predictions
  ordered = tf.sort(tf.reshape(squared, [-1]))
  return {"median": metrics.mean(ordered[tf.size(ordered) // 2])}


def _in_batch_top1(features, loss, squared, predictions):
  """A retrieval metric over in-batch candidates, the rows' similarity
  matrix (off the loss's path, so not refused): the share of rows whose
  most similar row is their own. Its inputs are per row, so its sum over
  towers was taken, each tower's over its own shard's candidates (a1c186a:
  silently 1.0 on 1-row shards)."""
  del loss, squared, predictions
  x = features["x"]
  similarity = tf.matmul(x, x * 0.5 + 0.1, transpose_b=True)
  own = tf.range(tf.shape(x)[0])
  best = tf.argmax(similarity, axis=1, output_type=tf.int32)
  return {"in_batch_top1": metrics.mean(tf.cast(tf.equal(best, own),
                                                tf.float32))}


def _corpus_over_a_size(features, loss, squared, predictions):
  """The corpus score over the size of a tensor of no rows, which
  TensorFlow folds to a constant on batches of either size: it stays."""
  del features, loss, squared
  score = tf.compat.v1.py_func(
      lambda p: np.float32(np.median(p) + p[0, 0] - p[-1, 0]),
      [predictions], tf.float32, stateful=False)
  size = tf.cast(tf.size(tf.zeros([2, 2])), tf.float32)
  return {"corpus": metrics.mean(score / size)}


def _median_across(features, loss, squared, predictions):
  """The median of the rows laid along dimension 1: on a batch of known
  size its shape, folded to a constant, is [1, rows]."""
  del features, loss, predictions
  across = tf.sort(tf.transpose(squared), axis=1)
  return {"median": metrics.mean(across[0, tf.shape(across)[1] // 2])}


# On (3, [2], True) every tower with rows holds one: a shape folded from
# the shard's cannot be told from a shape of something else.
ONE_ROW = (3, [2], True)
WHOLE_BATCH_CASES = (
    [(fn, case) for fn in (_corpus, _corpus_weighted) for case in CASES] +
    [(fn, case) for fn in (_in_batch_top1, _median, _median_across,
                           _corpus_over_a_size)
     for case in CASES if case != ONE_ROW])


@pytest.mark.parametrize("metric_fn,case", WHOLE_BATCH_CASES)
def test_value_no_combination_gives_is_computed_on_the_whole_batch(
    metric_fn, case):
  """A py_func corpus score (in input order: its first and last rows) and a
  median: 52-106 % off on 6b12641 on batches of unknown size (the
  Transformer's BLEU), refused on batches of known size, where its ops had
  the shard's shapes; its `weights=tf.constant(1.0)` form (the
  Transformer's) and an in-batch retrieval metric still off on a1c186a.
  Now built again on the whole batch's rows, shapes and all."""
  towers, batches, static = case
  model_fn = _model_fn(metric_fn)
  expected = _evaluated(model_fn, batches, static)
  got = _evaluated(replicate.replicate_model_fn(model_fn,
                                                devices=cpus(towers)),
                   batches, static)
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7,
                               err_msg=key)


def test_a_folded_shape_the_towers_cannot_tell_is_refused_with_the_fix():
  """On a batch of known size TensorFlow folds `tf.shape(x)` to a constant;
  replicate reads the whole batch's off the towers' constants (the median,
  the in-batch `tf.range` above). With one row in every tower a [1] shape
  cannot be told from a shape of something else: refused, naming the
  first (`tf.size(ordered)`), and the fix (test_the_fix_is_exact holds the
  fix)."""
  model_fn = replicate.replicate_model_fn(_model_fn(_median),
                                          devices=cpus(ONE_ROW[0]))
  with pytest.raises(ValueError, match=(
      r"eval_metric_ops\['median'\].*whole batch's rows.*reads "
      r"'Size:0'.*folded to a constant.*every tower holds one row.*"
      r"TPUEstimatorSpec.*eval_metrics.*metric_fn once")):
    _evaluated(model_fn, ONE_ROW[1], True)


def _tpu_model_fn(features, labels, mode):
  """The fix the refusal gives: the corpus score in a metric_fn."""
  predictions = tf.compat.v1.layers.dense(
      features["x"], 1, name="dense",
      kernel_initializer=tf.compat.v1.constant_initializer(KERNEL))
  loss = tf.reduce_mean(tf.square(predictions - labels))

  def metric_fn(predictions):
    return _corpus(None, None, None, predictions)

  return tpu.TPUEstimatorSpec(mode, loss=loss,
                              eval_metrics=(metric_fn, [predictions]))


@pytest.mark.parametrize("towers,batches,static", CASES)
def test_the_fix_is_exact(towers, batches, static):
  def as_spec(model_fn):
    def converted(**kwargs):
      spec = model_fn(**kwargs)
      return spec.as_estimator_spec() if isinstance(
          spec, tpu.TPUEstimatorSpec) else spec
    return converted

  expected = _evaluated(as_spec(_tpu_model_fn), batches, static)
  got = _evaluated(replicate.replicate_model_fn(_tpu_model_fn,
                                                devices=cpus(towers)),
                   batches, static)
  assert got["corpus"] == pytest.approx(expected["corpus"], rel=1e-6)
  medians = []
  start = 0
  for rows in batches:
    p = X[start:start + rows] @ KERNEL
    medians.append(np.median(p) + p[0, 0] - p[-1, 0])
    start += rows
  assert expected["corpus"] == pytest.approx(np.mean(medians), rel=1e-5)


def test_estimator_evaluate_mean_of_loss(tmp_path):
  model_fn = _model_fn(_mean_of_loss)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(
        ({"x": X, "w": W, "y": Y}, Y)).batch(5)  # batches of 5 and 4

  def evaluate(fn, name):
    with tf.Graph().as_default():  # a checkpoint of the initial values
      tf.compat.v1.train.get_or_create_global_step()
      model_fn(features={"x": tf.constant(X)}, labels=tf.constant(Y),
               mode=tf.estimator.ModeKeys.PREDICT)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        tf.compat.v1.train.Saver().save(session,
                                        str(tmp_path / name / "model.ckpt"))
    estimator = tf.estimator.Estimator(
        fn, model_dir=str(tmp_path / name),
        config=tf.estimator.RunConfig(session_config=session_config()))
    return estimator.evaluate(input_fn, steps=2)

  expected = evaluate(model_fn, "one")
  got = evaluate(replicate.replicate_model_fn(model_fn, devices=cpus(3)),
                 "three")
  assert got["loss_mean"] == pytest.approx(expected["loss_mean"], rel=1e-6)
  assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def _shared_reader(features, loss, squared, predictions):
  """The op fed the batch's max also feeds a prediction."""
  del loss, squared, predictions
  scaled = tf.reduce_max(features["x"]) * 2.0
  tf.compat.v1.add_to_collection("shared_reader", scaled)
  return {"scaled_max": metrics.mean(scaled)}


def test_metric_input_also_read_by_rows_is_the_batchs_in_both():
  # The batch's max flows back into per-row predictions, so it is the
  # whole batch's in every tower (replicate.shard.batch_reductions) before
  # the metric reads it: the metric and the rows both get one device's
  # value, where rewiring the metric alone had to be refused.
  def model_fn(features, labels, mode):
    spec = _model_fn(_shared_reader)(features, labels, mode)
    scaled = tf.compat.v1.get_collection("shared_reader")[-1]
    return spec._replace(predictions={"p": spec.predictions,
                                      "s": spec.predictions * scaled})

  expected = _evaluated(model_fn, [5], True)
  got = _evaluated(replicate.replicate_model_fn(model_fn, devices=cpus(2)),
                   [5], True)
  np.testing.assert_allclose(got["scaled_max"], expected["scaled_max"],
                             rtol=1e-6)
  assert expected["scaled_max"] == pytest.approx(2 * X[:5].max(), rel=1e-6)
