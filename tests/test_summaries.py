"""Summaries made in the model_fn: once each, under their own tags.

A summary of a value over the batch (the loss, a mean over the rows, a
count of rows) holds the whole batch's, as one device's; one of per-row values holds tower 0's
shard (as MirroredStrategy records the first replica's); towers 1..N-1
add no `tower_i/...` copies.
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers
X = np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1)
Y = 2.0 * X


def _model_fn(features, labels, mode):
  weight = tf.compat.v1.get_variable("weight", [1, 1],
                                     initializer=tf.zeros_initializer())
  prediction = tf.matmul(features, weight)
  loss = tf.compat.v1.losses.mean_squared_error(labels, prediction)
  tf.compat.v1.summary.scalar("my_loss", loss)
  tf.compat.v1.summary.histogram("predictions", prediction)
  with tf.name_scope("inputs"):
    tf.compat.v1.summary.scalar("rows", tf.shape(features)[0])
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.01)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _summaries(model_fn):
  """The SUMMARIES collection's tags after building `model_fn` in TRAIN."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    model_fn(tf.constant(X), tf.constant(Y), TRAIN)
    merged = tf.compat.v1.summary.merge_all()
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      summary = tf.compat.v1.Summary.FromString(session.run(merged))
    ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
    return sorted(op.name for op in ops), {
        value.tag: value.simple_value for value in summary.value
        if value.HasField("simple_value")}


@pytest.mark.parametrize("towers", [2, 3])
def test_each_summary_is_made_once_with_tower0s_shard(towers):
  names, values = _summaries(_model_fn)
  assert names == ["inputs/rows:0", "my_loss:0", "predictions:0"]
  assert values["inputs/rows"] == ROWS
  got_names, got_values = _summaries(replicate.replicate_model_fn(
      _model_fn, devices=cpus(towers)))
  assert got_names == names
  # The loss is the whole batch's (tower 0's shard's on 6b12641): with the
  # weight at 0, the mean of y^2 = (2r)^2 over the 7 rows. A count of rows
  # is the batch's too (tower 0's shard's, 4 or 3 of 7, on a1c186a).
  assert got_values["my_loss"] == pytest.approx(np.mean(Y ** 2))
  assert got_values["my_loss"] == pytest.approx(values["my_loss"])
  assert got_values["inputs/rows"] == ROWS


def _event_tags(model_dir):
  tags = set()
  for path in glob.glob(os.path.join(model_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(value.tag for value in event.summary.value)
  return tags


@pytest.mark.parametrize("towers", [2, 3])
def test_an_estimator_writes_only_the_unwrapped_tags(towers, tmp_path):
  tags = []
  for model_fn, count in ((_model_fn, 1), (replicate.replicate_model_fn(
      _model_fn), towers)):
    model_dir = str(tmp_path / str(count))
    tf.estimator.Estimator(
        model_fn, model_dir=model_dir,
        config=tf.estimator.RunConfig(session_config=session_config(count),
                                      save_summary_steps=1)).train(
            lambda: tf.data.Dataset.from_tensors((X, Y)).repeat(2))
    tags.append(_event_tags(model_dir))
  unwrapped, wrapped = tags
  assert {"my_loss", "predictions", "inputs/rows", "loss"} <= unwrapped
  assert wrapped == unwrapped
