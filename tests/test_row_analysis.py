"""The row analysis at index ops: real idioms as their authors write them.

`replicate.graph.row_layout` follows, for each tensor a tower computes,
which axis carries its rows and whether an integer tensor's values are the
tower's own row positions; `replicate.graph.index_rules` lets an index op
pass exactly when it maps each row to itself. Each idiom here was refused
on 6b12641 (or, for the reversal, let through), and each one that passes
is compared with the unwrapped model_fn on one device: canned linear and
wide & deep estimators with crossed columns (tensorflow/models' census
example), TF-Ranking's groupwise score scatter, the Transformer's pad
remover, confusion-matrix metrics under TF 1 behaviour.
"""

import os
import re
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
fc = tf.feature_column
ModeKeys = tf.estimator.ModeKeys

ROWS = 7
_rng = np.random.RandomState(3)
EDUCATION = np.array([[e] for e in "abcabca"]).astype(bytes)
JOB = np.array([[j] for j in "xyyxzzx"]).astype(bytes)
AGE = _rng.rand(ROWS, 1).astype(np.float32)
LABEL = np.array([0, 1, 1, 0, 1, 0, 0], np.int64)


# ---------------------------------------------------------------------------
# Crossed columns in canned estimators (census wide & deep).


def _census_columns():
  education = fc.categorical_column_with_vocabulary_list("education",
                                                         [b"a", b"b", b"c"])
  job = fc.categorical_column_with_hash_bucket("job", 5)
  crossed = fc.crossed_column(["education", "job"], hash_bucket_size=7)
  return education, job, crossed, fc.numeric_column("age")


def _census(kind, family, model_dir):
  education, job, crossed, age = _census_columns()
  v2 = family == "v2"
  module = tf.estimator if v2 else tf.compat.v1.estimator
  optimizer = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.Ftrl(0.1)) if v2 else
      (lambda: tf.compat.v1.train.FtrlOptimizer(0.1)))
  deep = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.Adagrad(0.1)) if v2 else
      (lambda: tf.compat.v1.train.AdagradOptimizer(0.1)))
  if kind == "linear":
    return module.LinearClassifier([education, job, crossed, age],
                                   optimizer=optimizer, model_dir=model_dir)
  return module.DNNClassifier([3], [age, fc.embedding_column(crossed, 2)],
                              optimizer=deep, model_dir=model_dir)


def _census_input():
  return tf.data.Dataset.from_tensor_slices((
      {"education": EDUCATION, "job": JOB, "age": AGE}, LABEL)).batch(4)


def _census_outcome(estimator):
  estimator.train(_census_input)
  metrics = estimator.evaluate(_census_input)
  predictions = np.array([p["probabilities"] for p in estimator.predict(
      lambda: _census_input().map(lambda x, y: x))])
  return metrics, predictions


# The wide & deep forms, v1 and TF 2, are the zoo's (oracle_zoo_rows.py).
@pytest.mark.parametrize("kind, family, towers", [
    ("linear", "v1", 2), ("dnn_embedded_cross", "v2", 3)])
def test_crossed_columns_in_canned_estimators_are_exact(kind, family, towers,
                                                        tmp_path):
  start, unwrapped, wrapped = (str(tmp_path / name) for name in
                               ("start", "unwrapped", "wrapped"))
  _census(kind, family, start).train(_census_input, steps=1)
  shutil.copytree(start, unwrapped)
  shutil.copytree(start, wrapped)
  expected = _census_outcome(_census(kind, family, unwrapped))
  canned = _census(kind, family, wrapped)
  reduction = Reduction.SUM if family == "v1" else (
      Reduction.SUM_BY_NONZERO_WEIGHTS)
  actual = _census_outcome(tf.estimator.Estimator(
      replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction),
      model_dir=wrapped,
      config=tf.estimator.RunConfig(session_config=session_config(towers))))
  assert actual[0]["global_step"] == expected[0]["global_step"] == 3
  for key in ("loss", "average_loss", "accuracy", "auc"):
    np.testing.assert_allclose(actual[0][key], expected[0][key], rtol=1e-5,
                               err_msg=key)
  np.testing.assert_allclose(actual[1], expected[1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# TF-Ranking's groupwise scatter and the Transformer's pad remover (the
# zoo's models, tests/oracle/oracle_zoo_rows.py), trained on batches of 7
# rows (4 + 3, 3 + 2 + 2): every variable and loss as on one device.

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracle"))
import oracle_zoo_rows as zoo_rows  # noqa: E402  pylint: disable=C0413

IDIOMS = {"ranking": (zoo_rows.ranking_model_fn, zoo_rows.ranking_data()),
          "pad_remover": (zoo_rows.pad_remover_model_fn,
                          zoo_rows.pad_remover_data())}


@pytest.mark.parametrize("name, towers, static", [
    ("ranking", 2, False), ("ranking", 3, True), ("pad_remover", 2, True),
    ("pad_remover", 3, False), ("pad_remover", 3, True)])
def test_index_idioms_that_keep_rows_apart_train_exactly(name, towers,
                                                         static):
  """`static`: batches of known size, where TensorFlow folds `tf.shape(x)`
  to constants (the same decision as for unknown sizes)."""
  model_fn, (features, labels) = IDIOMS[name]
  batch = dict(features, y=labels)
  graphs = []
  expected, actual = harness.train_both(
      model_fn, towers, [batch, batch], static=static,
      after_fetches=lambda graph: graphs.append(graph) or {})
  assert len(expected.steps) == len(actual.steps) == 2
  harness.assert_trained_alike(expected, actual)
  # Per tower: each tower scatters its own rows (no all_rows gather).
  scatters = [op.name for op in graphs[1].get_operations()
              if op.type == "ScatterNd"]
  assert any(n.startswith("tower_{}/".format(towers - 1)) for n in scatters)
  assert not [op for op in graphs[1].get_operations()
              if "all_rows" in op.name.lower()]


def test_groupwise_scatter_of_long_lists_of_known_size_trains_exactly():
  """TF-Ranking's index tuples `tf.ones_like(items) * tf.expand_dims(
  tf.range(batch_size), 1)` on lists as long as its LibSVM example's (100
  items): of a known shape with 1000 entries or more, TensorFlow builds
  `tf.ones_like` as a `Fill` rather than a constant, whose ones the
  analysis must still see (refused on a1c186a: the row part was taken for
  each row's start `row * k`)."""
  rng = np.random.RandomState(36)
  items = rng.randn(8, 250, 2).astype(np.float32)
  items[[1, 6], 200:] = 0.0  # two lists of 200 items
  batch = {"items": items, "y": (items[:, :, 0] > 0).astype(np.float32)}
  expected, actual = harness.train_both(zoo_rows.ranking_model_fn, 2,
                                        [batch, batch], static=True)
  harness.assert_trained_alike(expected, actual)


def _gather_indexes(sequence_tensor, positions):
  """google-research/bert's masked-LM gather, as written there: the batch
  size from the static shape when known (a Python number), else the run's."""
  batch_size, seq_length, width = sequence_tensor.shape.as_list()
  if batch_size is None:
    batch_size = tf.shape(sequence_tensor)[0]
  flat_offsets = tf.reshape(
      tf.range(0, batch_size, dtype=tf.int32) * seq_length, [-1, 1])
  flat_positions = tf.reshape(positions + flat_offsets, [-1])
  flat_sequence_tensor = tf.reshape(sequence_tensor,
                                    [batch_size * seq_length, width])
  return tf.gather(flat_sequence_tensor, flat_positions)


def _masked_lm_model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(
      features["x"], 4, name="hidden",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  picked = _gather_indexes(hidden, features["positions"])
  logits = tf.compat.v1.layers.dense(
      picked, 3, name="logits",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=6))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      tf.reshape(labels, [-1]), logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(
      loss, tf.compat.v1.train.get_global_step()))


@pytest.mark.parametrize("towers, static", [(2, True), (3, True), (3, False)])
def test_berts_masked_lm_gather_trains_exactly(towers, static):
  """Each row's masked positions plus its offset `row * seq_length`: rows
  kept apart, whether the batch size is a number (static: `tf.range` of
  constants, refused on c34de2d) or known only when run."""
  rng = np.random.RandomState(11)
  batches = [{"x": rng.rand(4, 5, 3).astype(np.float32),
              "positions": rng.randint(0, 5, (4, 2)).astype(np.int32),
              "y": rng.randint(0, 3, (4, 2)).astype(np.int64)}
             for _ in range(2)]
  expected, actual = harness.train_both(_masked_lm_model_fn, towers, batches,
                                        static=static, known_rows=static)
  harness.assert_trained_alike(expected, actual)


def _rnn_model_fn(pick):
  """`dynamic_rnn` (a TF 2 while loop over time), then each row's last
  relevant output, picked as RNN tutorials write it."""

  def model_fn(features, labels, mode):
    lengths = features["lengths"]
    cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(4)
    with tf.compat.v1.variable_scope(
        "rnn", initializer=tf.compat.v1.glorot_uniform_initializer(seed=3)):
      outputs, _ = tf.compat.v1.nn.dynamic_rnn(
          cell, features["x"], sequence_length=lengths, dtype=tf.float32)
    rows, length = tf.shape(outputs)[0], tf.shape(outputs)[1]
    if pick == "flat":  # positions in the [rows * length, 4] reshape
      last = tf.gather(tf.reshape(outputs, [-1, 4]),
                       tf.range(0, rows) * length + (lengths - 1))
    elif pick == "gather_nd":
      last = tf.gather_nd(outputs, tf.stack([tf.range(rows), lengths - 1], 1))
    else:  # "reversed": every row reads another row's last output
      last = tf.gather(outputs[:, -1], tf.range(rows - 1, -1, -1))
    return harness.classifier_spec(last, labels, mode)

  return model_fn


def _rnn_batches():
  rng = np.random.RandomState(12)
  return [{"x": rng.rand(5, 6, 3).astype(np.float32),
           "lengths": rng.randint(1, 7, 5).astype(np.int32),
           "y": rng.randint(0, 3, 5).astype(np.int64)} for _ in range(2)]


@pytest.mark.parametrize("pick, towers, static", [
    ("flat", 2, False), ("flat", 3, True), ("gather_nd", 3, False)])
def test_an_rnns_last_relevant_output_trains_exactly(pick, towers, static):
  """The rows of the loop's outputs are followed through its body (they
  were UNKNOWN on c34de2d, and the gathers refused)."""
  expected, actual = harness.train_both(_rnn_model_fn(pick), towers,
                                        _rnn_batches(), static=static,
                                        known_rows=static)
  harness.assert_trained_alike(expected, actual)


def _crf_score_model_fn(pick):
  """A tag sequence's score from the potentials, picked as tfa's
  `crf_sequence_score` does it (tf_ner's BiLSTM-CRF), both refused on
  f65e512: "first": each row's potential of its first tag by index tuples
  (row, 0) extended with the tag (sequences of one step); "unary": every
  step's, by flat positions: the rows' starts times the steps times the
  tags, plus each step's, plus the tags."""

  def model_fn(features, labels, mode):
    weight = tf.compat.v1.get_variable("weight", initializer=np.arange(
        12, dtype=np.float32).reshape(3, 4) / 10.)
    potentials = tf.tensordot(features["x"], weight, 1)  # [rows, time, 4]
    rows, steps, tags = tf.unstack(tf.shape(potentials))
    if pick == "first":
      firsts = tf.reshape(tf.range(rows), [-1, 1])
      firsts = tf.concat([firsts, tf.zeros_like(firsts)], axis=1)
      tag = tf.reshape(tf.gather_nd(labels, firsts), [-1, 1])
      score = tf.gather_nd(potentials, tf.concat([firsts, tag], axis=1))
    else:
      starts = tf.expand_dims(tf.range(rows) * steps * tags, 1)
      positions = starts + tf.expand_dims(tf.range(steps) * tags, 0)
      score = tf.reduce_sum(tf.reshape(tf.gather(
          tf.reshape(potentials, [-1]), tf.reshape(positions + labels, [-1])),
                                       [rows, steps]), 1)
    # Squared: the gradient reads the score, so that under TF 1 behaviour
    # the update of the (ref) weight waits for the step's read of it.
    loss = tf.reduce_mean(tf.square(score - 1.))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=(
        optimizer.minimize(loss, tf.compat.v1.train.get_global_step())))

  return model_fn


@pytest.mark.parametrize("pick, towers, static", [
    ("first", 2, False), ("first", 3, True), ("unary", 2, True),
    ("unary", 3, False)])
def test_a_crf_sequence_score_trains_exactly(pick, towers, static):
  rng = np.random.RandomState(13)
  batches = [{"x": rng.rand(7, 5, 3).astype(np.float32),
              "y": rng.randint(0, 4, (7, 5)).astype(np.int32)}
             for _ in range(2)]
  expected, actual = harness.train_both(_crf_score_model_fn(pick), towers,
                                        batches, static=static,
                                        known_rows=static)
  harness.assert_trained_alike(expected, actual)


def test_rows_reversed_after_an_rnn_are_refused():
  """TF 2 control flow (a `While` whose body is followed), and a TF 1 loop
  (`Enter` ... `Exit`, `REPLICATE_TF1_BEHAVIOR=1`) through its frame
  (tests/test_loop_rows.py runs both control flows in one process)."""
  with pytest.raises(ValueError, match="GatherV2.*combines different rows"):
    harness.train(_rnn_model_fn("reversed"), _rnn_batches(), 2)


# ---------------------------------------------------------------------------
# Confusion-matrix metrics: a sum over rows that only metrics read.


def _segmenter_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(
      features["x"], 3, name="logits",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
  classes = tf.argmax(logits, 1)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
      "mean_iou": tf.compat.v1.metrics.mean_iou(labels, classes, 3),
      "per_class": tf.compat.v1.metrics.mean_per_class_accuracy(
          labels, classes, 3)})


def _segmenter_input():
  rng = np.random.RandomState(8)
  x = rng.randn(ROWS, 2).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices(
      ({"x": x}, np.arange(ROWS) % 3)).batch(4)


@pytest.mark.parametrize("towers", [2, 3])
def test_confusion_matrix_metrics_are_exact(towers, tmp_path):
  """A tf.scatter_nd into a [classes, classes] matrix keyed by labels sums
  rows; only the metric reads it, whose totals add the towers' (refused
  as an unknown ScatterNd under TF 1 behaviour on 6b12641)."""
  model_dir = str(tmp_path)
  config = tf.estimator.RunConfig(session_config=session_config(towers))
  expected = tf.estimator.Estimator(
      _segmenter_model_fn, model_dir=model_dir, config=config).evaluate(
          _segmenter_input)
  actual = tf.estimator.Estimator(
      replicate.replicate_model_fn(_segmenter_model_fn), model_dir=model_dir,
      config=config).evaluate(_segmenter_input)
  assert 0.0 < expected["mean_iou"] < 1.0
  for key in ("loss", "mean_iou", "per_class"):
    np.testing.assert_allclose(actual[key], expected[key], rtol=1e-6,
                               err_msg=key)


def _class_sums_model_fn(on_loss):
  """Per-class sums of the rows keyed by their labels: read by a metric
  only (exact: a sum over rows), or on the loss (refused)."""
  def model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.dense(features["x"], 3, name="hidden")
    sums = tf.math.unsorted_segment_sum(hidden, labels, 3)
    loss = tf.reduce_mean(tf.square(hidden))
    if on_loss:
      loss += tf.reduce_sum(tf.nn.softmax(sums))
    metric = tf.compat.v1.metrics.mean(tf.reduce_max(sums, 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops={"sums": metric})
  return model_fn


@pytest.mark.parametrize("on_loss", [False, True])
def test_a_sum_over_rows_keyed_by_labels_passes_only_where_metrics_read_it(
    on_loss):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    wrapped = replicate.replicate_model_fn(_class_sums_model_fn(on_loss),
                                           devices=cpus(2))
    features = {"x": tf.compat.v1.placeholder(tf.float32, [None, 2])}
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    if not on_loss:
      assert wrapped(features, labels, ModeKeys.EVAL).loss is not None
      return
    with pytest.raises(ValueError, match=(
        r"The UnsortedSegmentSum op '[^']+' combines different rows.*sums "
        r"the rows' values into entries keyed by segment ids")):
      wrapped(features, labels, ModeKeys.EVAL)


# ---------------------------------------------------------------------------
# A refused index op's fix, applied as the message writes it.


def _reversal_model_fn(fixed):
  def model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.dense(
        features["x"], 3, tf.nn.tanh, name="hidden",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=9))
    if fixed:  # the message's example, as it is written
      h = hidden
      whole = replicate.all_rows(h)
      n = tf.shape(whole)[0]
      y = tf.gather(whole, tf.range(n - 1, -1, -1))[replicate.row_offset():][
          :tf.shape(h)[0]]
    else:
      n = tf.shape(hidden)[0]
      y = tf.gather(hidden, tf.range(n - 1, -1, -1))
    output = tf.compat.v1.layers.dense(
        hidden * y, 1, name="output",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=10))
    loss = tf.compat.v1.losses.mean_squared_error(labels, output)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _reversal_batch():
  rng = np.random.RandomState(11)
  return {"x": rng.randn(ROWS, 2).astype(np.float32),
          "y": rng.randn(ROWS, 1).astype(np.float32)}


@pytest.mark.parametrize("towers", [2, 3])
def test_a_refused_gathers_fix_as_the_message_writes_it_is_exact(towers):
  with pytest.raises(ValueError) as refused:
    harness.train(_reversal_model_fn(False), [_reversal_batch()], towers)
  message = str(refused.value)
  assert re.search(r"The GatherV2 op '[^']+' combines different rows.*not "
                   r"each row's own position", message), message
  example = ("whole = replicate.all_rows(h); n = tf.shape(whole)[0]; y = "
             "tf.gather(whole, tf.range(n - 1, -1, -1))"
             "[replicate.row_offset():][:tf.shape(h)[0]]")
  assert example in message
  batches = [_reversal_batch()] * 2
  expected = harness.train(_reversal_model_fn(False), batches)
  actual = harness.train(_reversal_model_fn(True), batches, towers)
  harness.assert_trained_alike(expected, actual)
