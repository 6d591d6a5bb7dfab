"""Predictions of any width, and the batch's reductions that widths come from.

A sequence tagger cuts its tokens at the batch's longest sequence
(`x[:, :tf.reduce_max(lengths)]`): every tower takes the whole batch's
longest, as one device does, so predictions and training are one device's.
A beam-search-like decoder stops when its own rows are done: each tower's
output is padded with zeros to the widest tower's, which is one device's
result for a model that pads with zeros. On main 2c8ec8c every test here
but the refusal raised `ConcatOp : Dimension 1 in both shapes must be
equal` (or trained on the towers' own widths).
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

# 7 rows: towers (4, 3) and (3, 2, 2); the longest rows in each differ.
LENGTHS = np.array([2, 5, 3, 1, 7, 4, 2], np.int32)
ROWS, PAD = len(LENGTHS), 9
VOCAB, TAGS, DIM = 11, 4, 3


def _tokens(seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, VOCAB, size=(ROWS, PAD)).astype(np.int32)
  tags = rng.randint(0, TAGS, size=(ROWS, PAD)).astype(np.int32)
  mask = np.arange(PAD)[None, :] < LENGTHS[:, None]
  return tokens * mask, tags * mask


def _variable(name, shape, seed):
  values = np.random.RandomState(seed).uniform(-1, 1, shape)
  return tf.compat.v1.get_variable(
      name, shape, tf.float32,
      initializer=tf.compat.v1.constant_initializer(values))


def _tagger(features, labels, mode):
  """Per-token tags up to the batch's longest sequence; a row-mean loss."""
  lengths = features["lengths"]
  width = tf.reduce_max(lengths)  # the batch's longest sequence
  tokens = features["tokens"][:, :width]
  embedded = tf.nn.embedding_lookup(_variable("embedding", [VOCAB, DIM], 1),
                                    tokens)
  mask = tf.sequence_mask(lengths, width, dtype=tf.float32)
  # The mean over the window depends on its width: the batch's.
  pooled = tf.reduce_sum(embedded, 1) / tf.cast(width, tf.float32)
  logits = (tf.einsum("ntd,dk->ntk", embedded,
                      _variable("token_kernel", [DIM, TAGS], 2)) +
            tf.matmul(pooled, _variable("pooled_kernel", [DIM, TAGS], 3))[
                :, None, :])
  predictions = {"tags": tf.argmax(logits, -1, output_type=tf.int32) *
                         tf.cast(mask, tf.int32),
                 "logits": logits}
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions=predictions,
        export_outputs={"serving_default": tf.estimator.export.PredictOutput(
            {"logits": logits})})
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels[:, :width], logits=logits)
  loss = tf.reduce_mean(tf.reduce_sum(xent * mask, 1) /
                        tf.cast(lengths, tf.float32))  # a mean over rows
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    predictions=predictions)


def _rnn_tagger(features, labels, mode):
  """`dynamic_rnn` with `sequence_length`, cut at the batch's longest."""
  lengths = features["lengths"]
  width = tf.reduce_max(lengths)
  embedded = tf.nn.embedding_lookup(_variable("embedding", [VOCAB, DIM], 1),
                                    features["tokens"])
  cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(DIM)
  with tf.compat.v1.variable_scope(
      "rnn", initializer=tf.compat.v1.random_uniform_initializer(
          -1, 1, seed=6)):
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(
        cell, embedded, sequence_length=lengths, dtype=tf.float32)
  logits = tf.einsum("ntd,dk->ntk", outputs[:, :width],
                     _variable("token_kernel", [DIM, TAGS], 2)) + 0.25
  predictions = {"logits": logits}
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  mask = tf.sequence_mask(lengths, width, dtype=tf.float32)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels[:, :width], logits=logits)
  loss = tf.reduce_mean(tf.reduce_sum(xent * mask, 1) /
                        tf.cast(lengths, tf.float32))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    predictions=predictions)


def _run(model_fn, towers, mode, fetch, steps=0, rows=ROWS):
  """Builds `model_fn` (wrapped on `towers`, or unwrapped for None) on an
  input pipeline of the batch, of unknown size; runs `steps` train steps,
  then `fetch(spec)`."""
  tokens, tags = _tokens()
  tokens, tags, lengths = tokens[:rows], tags[:rows], LENGTHS[:rows]
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensors(
        ({"tokens": tokens, "lengths": lengths}, tags)).repeat()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        dataset.unbatch().batch(rows)).get_next()
    if towers is not None:
      model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers))
    spec = model_fn(features=features, labels=labels, mode=mode)
    feed = None
    with tf.compat.v1.Session(config=session_config(towers or 1)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in range(steps):
        session.run(spec.train_op, feed)
      return session.run(fetch(spec), feed)


@pytest.mark.parametrize("towers", [2, 3])
def test_per_token_predictions_up_to_the_batch_s_longest(towers):
  fetch = lambda spec: (spec.predictions, spec.export_outputs[
      "serving_default"].outputs["logits"])
  expected, exported = _run(_tagger, None, PREDICT, fetch)
  assert expected["logits"].shape == (ROWS, LENGTHS.max(), TAGS)
  got, got_exported = _run(_tagger, towers, PREDICT, fetch)
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-6,
                               atol=1e-6, err_msg=key)
  np.testing.assert_allclose(got_exported, exported, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("towers", [2, 3])
def test_dynamic_rnn_predicts_and_trains_at_the_batch_s_longest(towers):
  fetch = lambda spec: spec.predictions["logits"]
  expected = _run(_rnn_tagger, None, PREDICT, fetch)
  assert expected.shape == (ROWS, LENGTHS.max(), TAGS)
  np.testing.assert_allclose(_run(_rnn_tagger, towers, PREDICT, fetch),
                             expected, rtol=1e-6, atol=1e-6)
  fetch = lambda spec: {v.op.name: v for v in
                        tf.compat.v1.trainable_variables()}
  initial = _run(_rnn_tagger, None, TRAIN, fetch)
  expected = _run(_rnn_tagger, None, TRAIN, fetch, steps=2)
  got = _run(_rnn_tagger, towers, TRAIN, fetch, steps=2)
  assert sorted(got) == sorted(expected) and len(expected) == 4
  for name, value in expected.items():
    assert np.abs(value - initial[name]).max() > 1e-3, name  # it trained
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("towers", [2, 3])
def test_eval_predictions_and_loss_at_the_batch_s_longest(towers):
  fetch = lambda spec: (spec.predictions["logits"], spec.loss)
  logits, loss = _run(_tagger, None, EVAL, fetch)
  got_logits, got_loss = _run(_tagger, towers, EVAL, fetch)
  np.testing.assert_allclose(got_logits, logits, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-6)


@pytest.mark.parametrize("towers", [2, 3])
def test_training_at_the_batch_s_longest_is_one_device_s(towers):
  fetch = lambda spec: {v.op.name: v for v in
                        tf.compat.v1.trainable_variables()}
  expected = _run(_tagger, None, TRAIN, fetch, steps=2)
  got = _run(_tagger, towers, TRAIN, fetch, steps=2)
  assert sorted(got) == sorted(expected) == [
      "embedding", "pooled_kernel", "token_kernel"]
  for name, value in expected.items():
    initial = _run(_tagger, None, TRAIN, fetch)[name]
    assert np.abs(value - initial).max() > 1e-3, name  # it trained
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _decoder(features, labels, mode):
  """A decoder whose loop stops when its own rows are done (beam search's).

  Row r emits one token a step until its own length, then zeros; its
  scores are floats. The loop runs until every row of the batch it is
  given is done, so a tower's output is as wide as its longest row.
  """
  del labels
  lengths = features["lengths"]
  scale = _variable("scale", [], 4)
  start = tf.cast(features["tokens"][:, 0], tf.float32) * scale

  def cond(step, unused_state, unused_tokens, unused_scores):
    return tf.reduce_any(step < lengths)  # my own rows are not all done

  def body(step, state, tokens, scores):
    alive = step < lengths
    state = state * 0.5 + 1.0
    token = tf.where(alive, tf.cast(state * 3.0, tf.int32) % VOCAB + 1, 0)
    return (step + 1, state, tokens.write(step, token),
            scores.write(step, tf.where(alive, state, 0.0)))

  _, _, tokens, scores = tf.while_loop(
      cond, body, (tf.constant(0), start,
                   tf.TensorArray(tf.int32, 0, dynamic_size=True),
                   tf.TensorArray(tf.float32, 0, dynamic_size=True)))
  decoded = tf.transpose(tokens.stack())  # [rows, own width]
  scores = tf.transpose(scores.stack())
  names = tf.where(decoded > 0, tf.strings.as_string(decoded), "")
  return tf.estimator.EstimatorSpec(
      mode, predictions={"tokens": decoded, "scores": scores,
                         "names": names},
      export_outputs={"serving_default": tf.estimator.export.PredictOutput(
          {"tokens": decoded, "scores": scores})})


@pytest.mark.parametrize("towers", [2, 3])
def test_a_decoder_stopping_when_its_own_rows_are_done(towers):
  fetch = lambda spec: (spec.predictions, spec.export_outputs[
      "serving_default"].outputs)
  expected, exported = _run(_decoder, None, PREDICT, fetch)
  assert expected["tokens"].shape == (ROWS, LENGTHS.max())
  assert (expected["tokens"] > 0).sum(axis=1).tolist() == LENGTHS.tolist()
  got, got_exported = _run(_decoder, towers, PREDICT, fetch)
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  for key in exported:
    np.testing.assert_array_equal(got_exported[key], exported[key],
                                  err_msg=key)


@pytest.mark.parametrize("model_fn", [_tagger, _decoder])
def test_a_batch_smaller_than_the_towers(model_fn):
  """A tower built on a stand-in row takes no part in the batch's width."""
  fetch = lambda spec: spec.predictions
  expected = _run(model_fn, None, PREDICT, fetch, rows=2)
  got = _run(model_fn, 3, PREDICT, fetch, rows=2)
  for key in expected:
    assert got[key].shape == expected[key].shape, key
    if expected[key].dtype == object:  # strings
      np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    else:
      np.testing.assert_allclose(got[key], expected[key], rtol=1e-6,
                                 atol=1e-6, err_msg=key)


def test_equal_static_widths_keep_their_static_shape(graph):
  def model_fn(features, mode):
    return tf.estimator.EstimatorSpec(
        mode, predictions={"x": features["x"] * 2.0},
        export_outputs={"serving_default": tf.estimator.export.PredictOutput(
            {"x": features["x"] * 2.0})})
  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      {"x": tf.ones([7, 5, 2])}, None, PREDICT)
  assert spec.predictions["x"].shape.as_list() == [7, 5, 2]
  assert spec.export_outputs["serving_default"].outputs["x"].shape.as_list(
  ) == [7, 5, 2]


def _centered(features, labels, mode):
  """Subtracts the batch's mean hidden value from every row: a gradient
  through a reduction over the batch."""
  hidden = tf.matmul(tf.cast(features["tokens"], tf.float32),
                     _variable("kernel", [PAD, 1], 5))
  centered = hidden - tf.reduce_mean(hidden, axis=0, name="batch_mean")
  predictions = {"centered": centered}
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.reduce_mean(tf.square(
      centered - tf.cast(labels[:, :1], tf.float32)))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.01)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    predictions=predictions)


@pytest.mark.parametrize("towers", [2, 3])
def test_a_differentiable_batch_reduction_into_rows_is_refused(towers):
  with pytest.raises(ValueError, match=r"'batch_mean'.*replicate\.all_rows"):
    _run(_centered, towers, TRAIN, lambda spec: spec.loss)
  # Without a gradient, the batch's mean is every tower's, as one device's.
  fetch = lambda spec: spec.predictions["centered"]
  expected = _run(_centered, None, PREDICT, fetch)
  np.testing.assert_allclose(_run(_centered, towers, PREDICT, fetch),
                             expected, rtol=1e-5, atol=1e-5)
  # tf.stop_gradient marks it as not differentiated: combined, and trained.
  def stopped(features, labels, mode):
    hidden = tf.matmul(tf.cast(features["tokens"], tf.float32),
                       _variable("kernel", [PAD, 1], 5))
    centered = hidden - tf.stop_gradient(tf.reduce_mean(hidden, axis=0))
    loss = tf.reduce_mean(tf.square(
        centered - tf.cast(labels[:, :1], tf.float32)))
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.001)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  fetch = lambda spec: tf.compat.v1.trainable_variables()[0]
  np.testing.assert_allclose(_run(stopped, towers, TRAIN, fetch, steps=2),
                             _run(stopped, None, TRAIN, fetch, steps=2),
                             rtol=1e-5, atol=1e-6)


def test_reductions_of_shapes_and_of_batch_norm_stay_the_tower_s(graph):
  """`tf.reduce_prod(tf.shape(x)[1:])` is not over the batch; batch norm's
  moments are batch norm's: training builds, as one device's."""
  def model_fn(features, labels, mode):
    x = features["x"]
    flat = tf.reshape(x, [-1, tf.reduce_prod(tf.shape(x)[1:])])
    hidden = tf.compat.v1.layers.dense(flat, 4)
    hidden = tf.keras.layers.BatchNormalization(name="bn")(
        hidden, training=True)
    loss = tf.reduce_mean(tf.square(hidden - labels))
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      predictions={"h": hidden})
  for sync in (True, False):
    spec = replicate.replicate_model_fn(
        model_fn, devices=cpus(3), sync_batch_norm=sync)(
            {"x": tf.ones([7, 2, 3])}, tf.ones([7, 4]), TRAIN)
    assert spec.train_op is not None
    assert not [op for op in graph.get_operations()
                if "batch_reduction_over_towers" in op.name]
