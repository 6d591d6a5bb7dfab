"""Values over the batch are the whole batch's wherever they are read.

guillaumegenthial/tf_ner's taggers (issue 38): `tf.sequence_mask(nwords)`
hides a `reduce_max(nwords)`. On 6b12641 the batch reductions were found
by walking back from the spec's outputs along data edges only, so a mask
reaching a metric's update through its resource variable's control edge
(EVAL), or a metric that feeds only a TRAIN `tf.summary.scalar`, kept the
tower's own longest row: `InvalidArgumentError` at the first step whose
towers' longest rows differ. Each test here compares the wrapped
`model_fn` (2 and 3 towers, both strategies) with the unwrapped one.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

metrics = tf.compat.v1.metrics

# Padded to the whole batch's longest (7), as `padded_batch` pads; every
# tower's own longest is shorter in some tower, on 2 and on 3 towers.
LENGTHS = np.array([2, 5, 3, 1, 7, 4, 2], np.int32)
ROWS, PAD = len(LENGTHS), int(LENGTHS.max())
VOCAB, TAGS, DIM = 11, 4, 3
STRATEGIES = ["parameter_server", "replicated"]


def _batch(seed):
  rng = np.random.RandomState(seed)
  mask = np.arange(PAD)[None, :] < LENGTHS[:, None]
  tokens = rng.randint(1, VOCAB, size=(ROWS, PAD)).astype(np.int32) * mask
  tags = rng.randint(0, TAGS, size=(ROWS, PAD)).astype(np.int32) * mask
  return {"tokens": tokens, "lengths": LENGTHS}, tags


def _variable(name, shape, seed):
  values = np.random.RandomState(seed).uniform(-1, 1, shape)
  return tf.compat.v1.get_variable(
      name, shape, tf.float32,
      initializer=tf.compat.v1.constant_initializer(values))


def _tagger(features, labels, mode):
  """A tf_ner-like tagger: a running sum over the tokens for an RNN, a
  per-token loss masked by `tf.sequence_mask(lengths)` (no maxlen), metrics
  weighted by a mask of their own, a TRAIN summary of a masked metric."""
  lengths = features["lengths"]
  embedded = tf.nn.embedding_lookup(_variable("embedding", [VOCAB, DIM], 1),
                                    features["tokens"])
  context = tf.cumsum(embedded, axis=1) + tf.cumsum(embedded, axis=1,
                                                    reverse=True)
  logits = tf.einsum("ntd,dk->ntk", tf.tanh(context),
                     _variable("kernel", [DIM, TAGS], 2))
  pred_ids = tf.argmax(logits, -1, output_type=tf.int32)
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"tags": pred_ids})
  # As tf_ner: the masks are the batch's longest wide, the tags the padded
  # width; equal on one device.
  loss_mask = tf.sequence_mask(lengths, dtype=tf.float32)
  token_losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  loss = tf.reduce_sum(token_losses * loss_mask) / tf.reduce_sum(loss_mask)
  weights = tf.sequence_mask(lengths)
  eval_metric_ops = {
      "acc": metrics.accuracy(labels, pred_ids, weights),
      "recall": metrics.recall(labels > 0, pred_ids > 0, weights),
      "fill": metrics.mean(tf.cast(lengths, tf.float32) /
                           tf.cast(tf.reduce_max(lengths), tf.float32)),
  }
  # tf_metrics' confusion matrices (a ScatterNd), under TF 1 behaviour too.
  eval_metric_ops["mean_iou"] = metrics.mean_iou(labels, pred_ids, TAGS,
                                                 weights=weights)
  if mode == EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops=eval_metric_ops)
  for name in ("acc", "fill"):  # as tf_ner: the scalar updates
    tf.compat.v1.summary.scalar(name, eval_metric_ops[name][1])
  # Values over the batch: the loss, a mean over the rows, one of a mask.
  tf.compat.v1.summary.scalar("loss", loss)
  tf.compat.v1.summary.scalar("mean_length", tf.reduce_mean(
      tf.cast(lengths, tf.float32)))
  tf.compat.v1.summary.scalar("token_accuracy", tf.reduce_sum(
      tf.cast(tf.equal(pred_ids, labels), tf.float32) * loss_mask) /
                              tf.reduce_sum(loss_mask))
  tf.compat.v1.summary.histogram("lengths", lengths)  # rows: tower 0's
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _run(model_fn, towers, mode, steps, strategy="parameter_server",
         static=False):
  """Runs `steps` batches (train steps or metric updates) of the batch,
  of unknown (or static) size; returns what each step and the end give."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    first = _batch(0)
    if static:
      inputs = tf.nest.map_structure(
          lambda v: tf.Variable(v, trainable=False, collections=[
              tf.compat.v1.GraphKeys.LOCAL_VARIABLES]), first)
      given = tf.nest.map_structure(tf.identity, inputs)
    else:
      inputs = given = tf.nest.map_structure(
          lambda v: tf.compat.v1.placeholder(
              tf.as_dtype(v.dtype), [None] + list(v.shape[1:])), first)
    features, labels = given
    if towers is not None:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=cpus(towers), variable_strategy=strategy)
    spec = model_fn(features=features, labels=labels, mode=mode)
    summaries = tf.compat.v1.summary.merge_all()
    with tf.compat.v1.Session(config=session_config(towers or 1)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      steps_run = []
      for step in range(steps):
        batch = _batch(step)
        if static:
          for variable, value in zip(tf.nest.flatten(inputs),
                                     tf.nest.flatten(batch)):
            variable.load(value, session)
          feed = None
        else:
          feed = dict(zip(tf.nest.flatten(inputs), tf.nest.flatten(batch)))
        if mode == TRAIN:
          fetches = [spec.train_op, spec.loss, summaries]
        elif mode == EVAL:
          fetches = [[u for _, u in spec.eval_metric_ops.values()],
                     spec.loss]
        else:
          fetches = spec.predictions
        steps_run.append(session.run(fetches, feed))
      if mode == TRAIN:
        end = {v.op.name: session.run(v)
               for v in tf.compat.v1.trainable_variables()}
      elif mode == EVAL:
        end = session.run({k: v for k, (v, _) in
                           spec.eval_metric_ops.items()})
      else:
        end = None
  return steps_run, end


def _summary_values(serialized):
  summary = tf.compat.v1.Summary()
  summary.ParseFromString(serialized)
  return {value.tag: value.simple_value for value in summary.value}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("towers", [2, 3])
def test_tagger_evaluates_as_one_device(towers, strategy):
  _, expected = _run(_tagger, None, EVAL, 2)
  _, got = _run(_tagger, towers, EVAL, 2, strategy)
  assert sorted(got) == sorted(expected)
  assert 0.3 < expected["fill"] < 0.5  # the 0.41
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("towers", [2, 3])
def test_tagger_trains_as_one_device(towers, strategy):
  steps, expected = _run(_tagger, None, TRAIN, 3)
  got_steps, got = _run(_tagger, towers, TRAIN, 3, strategy)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  for (_, loss, summary), (_, got_loss, got_summary) in zip(steps, got_steps):
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    values, got_values = (_summary_values(summary),
                          _summary_values(got_summary))
    assert sorted(got_values) == sorted(values)
    # The metrics' updates too (tower 0's on a1c186a): issue 38, item 4.
    for tag in ("loss", "mean_length", "token_accuracy", "acc", "fill"):
      np.testing.assert_allclose(got_values[tag], values[tag], rtol=1e-6,
                                 err_msg=tag)


# Reductions whose axes only the run knows ---------------------------------

_X = np.random.RandomState(5).randn(7, 3).astype(np.float32)
_Y = np.random.RandomState(6).randint(0, 4, size=(7,)).astype(np.int32)
_KERNEL = np.random.RandomState(7).randn(3, 4).astype(np.float32)


def _classifier(center):
  def model_fn(features, labels, mode):
    del mode
    logits = tf.compat.v1.layers.dense(
        center(features["x"]), 4, name="dense",
        kernel_initializer=tf.compat.v1.constant_initializer(_KERNEL))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=center(logits)))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(TRAIN, loss=loss, train_op=train_op)
  return model_fn


def _centered_inputs(x):
  """The inputs less their maximum over an axis the run gives (0: the
  batch's); the logits are left alone."""
  if x.shape[-1] == 4:
    return x
  axis = tf.compat.v1.placeholder_with_default(0, [])
  return x - tf.reduce_max(x, axis=axis, keepdims=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("towers", [2, 3])
def test_a_reduction_over_axes_known_when_run(towers, strategy):
  """On 6b12641 one copy of the axes check took unknown axes for "not the
  batch's", and the inputs were centred on each tower's own maximum:
  0.35 / 0.77 off after 6 steps."""
  from harness import train_both
  one, wrapped = train_both(_classifier(_centered_inputs), towers,
                            [(_X, _Y)] * 6, variable_strategy=strategy)
  for name, value in one.variables.items():
    np.testing.assert_allclose(wrapped.variables[name], value, rtol=1e-5,
                               atol=1e-6, err_msg=name)
  np.testing.assert_allclose(wrapped.per_step("loss"), one.per_step("loss"),
                             rtol=1e-5)


def test_a_differentiated_reduction_over_axes_known_when_run():
  """Over the classes (the default) it trains as one device; a run over
  the batch's axis fails with the refusal, before any update."""
  with tf.Graph().as_default():
    axis = tf.compat.v1.placeholder_with_default(1, [])
    center = lambda x: x - tf.reduce_max(x, axis=axis, keepdims=True) if (
        x.shape[-1] == 4) else x
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    spec = replicate.replicate_model_fn(_classifier(center), devices=cpus(2))(
        features={"x": x}, labels=y, mode=TRAIN)
    with tf.compat.v1.Session(config=session_config(2)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      before = session.run(tf.compat.v1.trainable_variables())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"reduction .{0,4}Max.{0,4} is over the batch axis.*"
                         r"replicate.all_rows"):
        session.run(spec.train_op, {x: _X, y: _Y, axis: 0})
      after = session.run(tf.compat.v1.trainable_variables())
      for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)
      session.run(spec.train_op, {x: _X, y: _Y})


# Predictions that are values over the batch ------------------------------


def _batch_level_predictions(features, labels, mode):
  del labels
  x = features["x"]
  total = tf.reduce_sum(x, axis=0)
  return tf.estimator.EstimatorSpec(mode, loss=tf.reduce_mean(x),
                                    predictions={
      "total": total, "scaled": total * 2.0, "mean": tf.reduce_mean(x),
      "centered": x - tf.reduce_mean(x, axis=0)})


def _predicted(model_fn, static):
  with tf.Graph().as_default():
    x = tf.constant(_X) if static else tf.compat.v1.placeholder(
        tf.float32, [None, 3])
    spec = model_fn(features={"x": x}, labels=None, mode=EVAL)
    with tf.compat.v1.Session(config=session_config()) as session:
      return session.run(spec.predictions, None if static else {x: _X})


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("towers", [2, 3])
def test_a_prediction_over_the_batch_is_the_whole_batch_s(towers, static):
  """On 6b12641 (EVAL): the towers' values concatenated for an unknown
  batch, refused for a known one."""
  expected = _predicted(_batch_level_predictions, static)
  got = _predicted(replicate.replicate_model_fn(
      _batch_level_predictions, devices=cpus(towers)), static)
  assert expected["total"].shape == (3,) and expected["mean"].shape == ()
  for key, value in expected.items():
    assert got[key].shape == value.shape, key
    np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7,
                               err_msg=key)


# A metric's weights that are values over the batch -----------------------

_LISTS = np.random.RandomState(8).randn(7, 3, 2).astype(np.float32)
_RELEVANCE = np.array([[1, 0, 0], [0, 0, 0], [0, 2, 1], [0, 0, 0], [1, 1, 0],
                       [0, 0, 1], [0, 0, 0]], np.float32)
_EXAMPLE_WEIGHTS = np.random.RandomState(9).uniform(
    0.5, 2, (7, 3)).astype(np.float32)


def _per_list_weights(weights, relevance):
  """TF-Ranking's `_per_example_weights_to_per_list_weights`, as written:
  a list with no relevant item gets the batch's mean list weight."""
  per_list_relevance = tf.reduce_sum(relevance, axis=1, keepdims=True)
  nonzero = tf.cast(per_list_relevance > 0, tf.float32)
  per_list_weights = tf.math.divide_no_nan(
      tf.reduce_sum(weights * relevance, axis=1, keepdims=True),
      per_list_relevance)
  sum_weights = tf.reduce_sum(per_list_weights)
  num_nonzero = tf.reduce_sum(nonzero)
  return tf.compat.v1.where(
      tf.cast(nonzero, tf.bool), per_list_weights,
      tf.ones_like(per_list_weights) * tf.math.divide_no_nan(
          sum_weights, num_nonzero))


def _ranker(features, labels, mode):
  scores = tf.squeeze(tf.compat.v1.layers.dense(
      features["x"], 1, name="score",
      kernel_initializer=tf.compat.v1.constant_initializer([[0.7], [-0.4]])),
      -1)
  weights = _per_list_weights(features["w"], labels)
  top_is_relevant = tf.cast(tf.gather(labels, tf.argmax(
      scores, axis=1, output_type=tf.int32), batch_dims=1) > 0, tf.float32)
  loss = tf.reduce_mean(tf.square(scores - labels))
  return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
      "precision_at_1": metrics.mean(top_is_relevant[:, None], weights),
      "weight": metrics.mean(weights)})


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("towers", [2, 3])
def test_ranking_metric_weights_over_the_batch(towers, strategy):
  """On 6b12641 a list without relevant items was weighted by its own
  tower's mean list weight in the metrics (1-4e-2 off)."""
  def evaluated(model_fn):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2])
      w = tf.compat.v1.placeholder(tf.float32, [None, 3])
      y = tf.compat.v1.placeholder(tf.float32, [None, 3])
      spec = model_fn(features={"x": x, "w": w}, labels=y, mode=EVAL)
      with tf.compat.v1.Session(config=session_config()) as session:
        session.run(tf.compat.v1.local_variables_initializer())
        session.run(tf.compat.v1.global_variables_initializer())
        session.run([u for _, u in spec.eval_metric_ops.values()],
                    {x: _LISTS, w: _EXAMPLE_WEIGHTS, y: _RELEVANCE})
        return session.run({k: v for k, (v, _) in
                            spec.eval_metric_ops.items()})

  expected = evaluated(_ranker)
  got = evaluated(replicate.replicate_model_fn(
      _ranker, devices=cpus(towers), variable_strategy=strategy))
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)
