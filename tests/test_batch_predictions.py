"""Predictions computed by ops that let rows meet, off the loss's path, are
computed once on the whole batch's rows (issue 38 item 3).

A prediction from an in-batch similarity (each row's nearest row of the
batch), a value no combination of the towers' gives (each row less the
batch's median, by a `py_func`), rows put in reverse by `tf.gather`, each
row's rank in the batch: on f65e512 each was refused when the towers were
built ("combines different rows of the batch"), in every mode, though one
device computes them and the loss does not read them. Now the towers'
per-row values up to those ops are gathered in input order and the ops
after them are built again on the whole batch's rows: the prediction is one
device's, on batches of known and unknown size, uneven ones included. A
metric reading such a prediction is one device's too.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

metrics = tf.compat.v1.metrics

_rng = np.random.RandomState(7)
X = _rng.randn(9, 3).astype(np.float32)
Y = _rng.randn(9, 1).astype(np.float32)
KERNEL = _rng.randn(3, 2).astype(np.float32)


def _median(values):
  return np.float32(np.median(values))


def _hidden(features):
  return tf.compat.v1.layers.dense(
      features["x"], 2, name="dense",
      kernel_initializer=tf.compat.v1.constant_initializer(KERNEL))


def _nearest(h):
  """Each row's most similar other row of the batch (an in-batch
  retrieval's prediction): the rows' similarity matrix."""
  similarity = tf.matmul(h, h * 0.5 + 0.1, transpose_b=True)
  own = tf.range(tf.shape(h)[0])
  masked = similarity - 1e3 * tf.one_hot(own, tf.shape(h)[0])
  return tf.argmax(masked, axis=1, output_type=tf.int32)


def _centered(h):
  """Each row less the batch's median (a py_func of every row)."""
  median = tf.compat.v1.py_func(_median, [h], tf.float32, stateful=False)
  return h - median


def _reversed(h):
  n = tf.shape(h)[0]
  return tf.gather(h, tf.range(n - 1, -1, -1))


def _rank(h):
  """Each row's rank in the batch by its first column."""
  return tf.argsort(tf.argsort(h[:, 0]))


PREDICTIONS = {"nearest": _nearest, "centered": _centered,
               "reversed": _reversed, "rank": _rank}


def _model_fn(names, metric=False, export=False):
  def model_fn(features, labels, mode):
    h = _hidden(features)
    loss = (None if labels is None else
            tf.reduce_mean(tf.square(h[:, :1] - labels)))
    predictions = {"h": h}
    predictions.update((name, PREDICTIONS[name](h)) for name in names)
    eval_metric_ops = None
    if metric:
      own = tf.range(tf.shape(h)[0])
      eval_metric_ops = {
          "nearest_is_next": metrics.accuracy(
              tf.math.floormod(own + 1, tf.shape(h)[0]),
              predictions["nearest"])}
    export_outputs = None
    if export:
      export_outputs = {"serving_default": tf.estimator.export.PredictOutput(
          {name: predictions[name] for name in names})}
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
            loss, tf.compat.v1.train.get_global_step()
        ) if mode == TRAIN else None
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, predictions=predictions, train_op=train_op,
        eval_metric_ops=eval_metric_ops, export_outputs=export_outputs)
  return model_fn


def _inputs(batches, static):
  """(features, labels, feeds): one feed per batch of `batches` rows."""
  if static:
    assert len(batches) == 1
    rows = batches[0]
    return {"x": tf.constant(X[:rows])}, tf.constant(Y[:rows]), [{}]
  features = {"x": tf.compat.v1.placeholder(tf.float32, [None, 3])}
  labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
  feeds, start = [], 0
  for rows in batches:
    part = slice(start, start + rows)
    feeds.append({features["x"]: X[part], labels: Y[part]})
    start += rows
  return features, labels, feeds


def _run(model_fn, batches, static, mode, fetch):
  """`fetch(spec)` after each batch (PREDICT), or the metrics after every
  batch's update ran (EVAL)."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    features, labels, feeds = _inputs(batches, static)
    spec = model_fn(features=features, labels=labels, mode=mode)
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      if mode == EVAL:
        for feed in feeds:
          session.run([u for _, u in spec.eval_metric_ops.values()], feed)
        return [session.run({k: v for k, (v, _) in
                             spec.eval_metric_ops.items()})]
      return [session.run(fetch(spec), feed) for feed in feeds]


CASES = [(2, [5], True), (3, [7], True), (2, [5, 4], False),
         (3, [7, 2], False), (3, [2], True), (2, [1], False)]


def _assert_equal(got, expected):
  assert len(got) == len(expected)
  for got_batch, expected_batch in zip(got, expected):
    assert sorted(got_batch) == sorted(expected_batch)
    for key, value in expected_batch.items():
      assert np.shape(got_batch[key]) == np.shape(value), key
      np.testing.assert_allclose(got_batch[key], value, rtol=1e-6,
                                 atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", sorted(PREDICTIONS))
@pytest.mark.parametrize("towers,batches,static", CASES)
def test_prediction_where_rows_meet_is_one_devices(name, towers, batches,
                                                   static):
  model_fn = _model_fn([name])
  expected = _run(model_fn, batches, static, PREDICT,
                  lambda spec: spec.predictions)
  got = _run(replicate.replicate_model_fn(model_fn, devices=cpus(towers)),
             batches, static, PREDICT, lambda spec: spec.predictions)
  _assert_equal(got, expected)


@pytest.mark.parametrize("towers,batches,static", CASES[:4])
def test_export_outputs_where_rows_meet_are_one_devices(towers, batches,
                                                        static):
  """The multi-tower graph's export outputs: the same whole-batch values
  (a SavedModel builds the model_fn as one tower, where they are its own)."""
  model_fn = _model_fn(sorted(PREDICTIONS), export=True)

  def outputs(spec):
    return dict(spec.export_outputs["serving_default"].outputs)

  expected = _run(model_fn, batches, static, PREDICT, outputs)
  got = _run(replicate.replicate_model_fn(model_fn, devices=cpus(towers)),
             batches, static, PREDICT, outputs)
  _assert_equal(got, expected)


@pytest.mark.parametrize("towers,batches,static", CASES[:4])
def test_metric_of_a_prediction_where_rows_meet_is_one_devices(
    towers, batches, static):
  """A metric reading the in-batch prediction: the share of rows whose
  nearest row is the next one, over every batch."""
  model_fn = _model_fn(["nearest"], metric=True)
  expected = _run(model_fn, batches, static, EVAL, None)
  got = _run(replicate.replicate_model_fn(model_fn, devices=cpus(towers)),
             batches, static, EVAL, None)
  _assert_equal(got, expected)


def test_training_with_such_predictions_is_one_devices():
  """TRAIN builds them too (an Estimator's predictions in every mode): the
  steps train as one device's."""
  model_fn = _model_fn(sorted(PREDICTIONS))

  def trained(fn):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      features, labels, feeds = _inputs([5, 4], False)
      spec = fn(features=features, labels=labels, mode=TRAIN)
      kernel = [v for v in tf.compat.v1.global_variables()
                if v.op.name == "dense/kernel"][0]
      with tf.compat.v1.Session(config=session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        losses = [session.run([spec.train_op, spec.loss], feed)[1]
                  for feed in feeds]
        return losses, session.run(kernel)

  expected = trained(model_fn)
  got = trained(replicate.replicate_model_fn(model_fn, devices=cpus(2)))
  assert not np.allclose(expected[1], KERNEL)
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-7)


def test_a_loss_where_rows_meet_is_still_refused_with_the_fix():
  """On the loss's path the gradient would be the towers' own: refused."""
  def model_fn(features, labels, mode):
    h = _hidden(features)
    loss = tf.reduce_mean(tf.square(_reversed(h)[:, :1] - labels))
    return tf.estimator.EstimatorSpec(mode, loss=loss, predictions={"h": h})

  with pytest.raises(ValueError, match=(
      r"GatherV2.*combines different rows.*replicate.all_rows")):
    _run(replicate.replicate_model_fn(model_fn, devices=cpus(2)), [5], True,
         EVAL, None)


def test_estimator_predict_in_batch_nearest(tmp_path):
  """Estimator.predict over a dataset of 5-row batches and a remainder, on
  2 towers, against one device from the same checkpoint."""
  model_fn = _model_fn(sorted(PREDICTIONS))

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(
        {"x": X}).batch(5)  # batches of 5 and 4

  def predicted(fn, name):
    config = tf.estimator.RunConfig(session_config=session_config(),
                                    tf_random_seed=1)
    estimator = tf.estimator.Estimator(fn, str(tmp_path / name),
                                       config=config)
    return list(estimator.predict(input_fn, yield_single_examples=False))

  expected = predicted(model_fn, "one")
  got = predicted(replicate.replicate_model_fn(model_fn, devices=cpus(2)),
                  "two")
  _assert_equal(got, expected)
  assert [len(batch["nearest"]) for batch in got] == [5, 4]
