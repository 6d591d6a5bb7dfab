"""Whole Estimator runs: train, evaluate, predict and export through towers.

A `tf.compat.v1.estimator.DNNClassifier` (a numeric column and an embedding
column) is wrapped with `devices=None` and a session config of 2 virtual CPUs,
so the wrapper finds 2 towers the way an Estimator user would get them. It
and the unwrapped classifier both warm-start from one shared checkpoint, so
they start from the same variables, and must then train, evaluate and
predict alike. (Wrapping does not move op seeds: the wrapper takes no op
seed and no Python random draw before or inside tower 0, see
test_seeded_start.py. The warm start makes the comparison independent of
Keras's seeding: Keras v2 initializers, which in TF 2 behaviour include a
`tf.compat.v1.layers.dense` default kernel, take their seeds from Python's
`random` or `tf.keras.utils.set_random_seed`, not from `tf_random_seed`.)

The data: 11 rows in batches of 4, i.e. 4, 4, 3 (the last one split 2, 1);
prediction on 9 rows, i.e. 4, 4, 1 (the last one leaves tower 1 empty).
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import checkpoint_values, session_config

Reduction = tf.compat.v1.losses.Reduction
fc = tf.feature_column

ROWS = 11
PREDICT_ROWS = 9
BATCH = 4
STEPS = 3  # one pass over 11 rows in batches of 4
_rng = np.random.RandomState(11)
X = _rng.rand(ROWS, 2).astype(np.float32)
COLOR = np.array(["red", "green", "blue", "green", "red", "blue", "blue",
                  "red", "green", "red", "green"]).reshape(ROWS, 1)
CLASS = np.array([0, 1, 2, 1, 0, 2, 2, 0, 1, 0, 1], np.int64)


def _columns():
  color = fc.categorical_column_with_vocabulary_list("color",
                                                     ["red", "green", "blue"])
  return [fc.numeric_column("x", shape=[2]), fc.embedding_column(color, 2)]


def _train_input():
  return tf.data.Dataset.from_tensor_slices(
      ({"x": X, "color": COLOR}, CLASS)).batch(BATCH)


def _predict_input():
  return tf.data.Dataset.from_tensor_slices({
      "x": X[:PREDICT_ROWS],
      "color": COLOR[:PREDICT_ROWS]
  }).batch(BATCH)


def _config(cpu_count):
  return tf.estimator.RunConfig(session_config=session_config(cpu_count),
                                tf_random_seed=42)


def _classifier(model_dir, warm_start_from=None):
  return tf.compat.v1.estimator.DNNClassifier(
      hidden_units=[8, 4], feature_columns=_columns(), n_classes=3,
      optimizer=replicate.TowerOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.1)),
      model_dir=model_dir, config=_config(1),
      warm_start_from=warm_start_from)


def _wrapped_classifier(model_dir, warm_start_from):
  canned = _classifier(model_dir)
  # compat.v1 canned heads sum their loss over the batch: Reduction.SUM.
  return tf.estimator.Estimator(
      model_fn=replicate.replicate_model_fn(
          canned.model_fn, loss_reduction=Reduction.SUM, devices=None),
      model_dir=model_dir, config=_config(2), warm_start_from=warm_start_from)


class _TowerScopes(tf.compat.v1.train.SessionRunHook):
  """Records the `tower_i` name scopes of the graph the Estimator built."""

  def __init__(self):
    self.scopes = None

  def begin(self):
    graph = tf.compat.v1.get_default_graph()
    self.scopes = {op.name.split("/")[0] for op in graph.get_operations()
                   if re.match(r"tower_\d+/", op.name)}


def _run(estimator):
  """Trains one pass, evaluates, predicts; notes the towers of each graph."""
  hooks = {mode: _TowerScopes() for mode in ("train", "eval", "predict")}
  estimator.train(_train_input, hooks=[hooks["train"]])
  metrics = estimator.evaluate(_train_input, hooks=[hooks["eval"]])
  predictions = list(estimator.predict(_predict_input,
                                       hooks=[hooks["predict"]]))
  return {
      "metrics": metrics,
      "predictions": predictions,
      "scopes": {mode: hook.scopes for mode, hook in hooks.items()},
      "checkpoint": checkpoint_values(estimator.model_dir),
  }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The wrapped and the unwrapped classifier, from one starting point."""
  start = str(tmp_path_factory.mktemp("start"))
  _classifier(start).train(_train_input, steps=1)
  wrapped = _wrapped_classifier(str(tmp_path_factory.mktemp("wrapped")),
                                warm_start_from=start)
  unwrapped = _classifier(str(tmp_path_factory.mktemp("unwrapped")),
                          warm_start_from=start)
  return {"wrapped": dict(_run(wrapped), estimator=wrapped),
          "unwrapped": dict(_run(unwrapped), estimator=unwrapped)}


def test_devices_none_builds_two_towers_in_every_mode(runs):
  # device_count={'CPU': 2} in the RunConfig: 2 towers, found by the wrapper.
  assert runs["wrapped"]["scopes"] == {
      "train": {"tower_1"}, "eval": {"tower_1"}, "predict": {"tower_1"}}
  assert runs["unwrapped"]["scopes"] == {
      "train": set(), "eval": set(), "predict": set()}


def test_training_advances_the_global_step_once_per_batch(runs):
  checkpoint = runs["wrapped"]["checkpoint"]
  assert checkpoint["global_step"] == STEPS  # warm start begins at step 0
  for name, value in checkpoint.items():
    assert np.all(np.isfinite(value)), name


def test_evaluation_reports_whole_data_metrics(runs):
  metrics = runs["wrapped"]["metrics"]
  assert metrics["global_step"] == STEPS
  for key in ("accuracy", "loss", "average_loss"):
    assert np.isfinite(metrics[key]), key
  # Accuracy over all 11 rows, not a mean of per-batch or per-tower values:
  # a whole number of rows right out of 11.
  right = metrics["accuracy"] * ROWS
  assert right == pytest.approx(round(right), abs=1e-4)
  assert 0 <= round(right) <= ROWS


def test_prediction_gives_one_result_per_row(runs):
  predictions = runs["wrapped"]["predictions"]
  assert len(predictions) == PREDICT_ROWS  # batches of 4, 4 and 1
  for prediction in predictions:
    assert prediction["probabilities"].shape == (3,)
    assert prediction["probabilities"].sum() == pytest.approx(1.0, rel=1e-5)
    assert prediction["class_ids"][0] == np.argmax(
        prediction["probabilities"])


def test_wrapped_classifier_matches_the_unwrapped_one(runs):
  wrapped, unwrapped = runs["wrapped"], runs["unwrapped"]
  assert sorted(wrapped["checkpoint"]) == sorted(unwrapped["checkpoint"])
  for name, value in unwrapped["checkpoint"].items():
    np.testing.assert_allclose(wrapped["checkpoint"][name], value, rtol=1e-5,
                               atol=1e-6, err_msg=name)
  for key in ("loss", "average_loss"):
    np.testing.assert_allclose(wrapped["metrics"][key],
                               unwrapped["metrics"][key], rtol=1e-5,
                               err_msg=key)
  assert wrapped["metrics"]["accuracy"] == pytest.approx(
      unwrapped["metrics"]["accuracy"], rel=1e-5)
  np.testing.assert_allclose(
      [p["probabilities"] for p in wrapped["predictions"]],
      [p["probabilities"] for p in unwrapped["predictions"]], rtol=1e-5,
      atol=1e-6)


def _example(x, color):
  return tf.train.Example(features=tf.train.Features(feature={
      "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
      "color": tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[color.encode()])),
  })).SerializeToString()


def test_export_serves_parsed_examples_like_predict(runs, tmp_path):
  estimator = runs["wrapped"]["estimator"]
  receiver = tf.estimator.export.build_parsing_serving_input_receiver_fn(
      fc.make_parse_example_spec(_columns()))
  export_dir = estimator.export_saved_model(str(tmp_path),
                                            receiver).decode()
  assert os.path.isdir(export_dir)
  assert os.path.isfile(os.path.join(export_dir, "saved_model.pb"))
  assert os.path.isdir(os.path.join(export_dir, "variables"))
  # Served in a default session (one CPU): rows 0..2 and the single row 8
  # give what estimator.predict gave for them.
  expected = np.array([p["probabilities"]
                       for p in runs["wrapped"]["predictions"]])
  with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    meta_graph = tf.compat.v1.saved_model.load(session, ["serve"], export_dir)
    signature = meta_graph.signature_def["predict"]
    for rows in ([0, 1, 2], [8]):
      served = session.run(
          signature.outputs["probabilities"].name, {
              signature.inputs["examples"].name: [
                  _example(X[r].tolist(), COLOR[r, 0]) for r in rows
              ]
          })
      np.testing.assert_allclose(served, expected[rows], rtol=1e-5,
                                 atol=1e-6)


# A custom model_fn: its checkpoint is the unwrapped model_fn's, name for name.


def _model_fn(features, labels, mode):
  table = tf.compat.v1.get_variable(
      "color_embedding", [3, 2],
      initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.6, 0.6, 6).reshape(3, 2)))
  embedded = tf.nn.embedding_lookup(table, features["color_id"][:, 0])
  hidden = tf.compat.v1.layers.dense(
      tf.concat([features["x"], embedded], axis=1), 5, tf.nn.relu,
      name="hidden", kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.4, 0.5, 20).reshape(4, 5)))
  logits = tf.compat.v1.layers.dense(
      hidden, 3, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(0.3, -0.3, 15).reshape(5, 3)))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _custom_input():
  color_id = np.array([[["red", "green", "blue"].index(c)]
                       for c in COLOR[:, 0]], np.int64)
  return tf.data.Dataset.from_tensor_slices(
      ({"x": X, "color_id": color_id}, CLASS)).batch(BATCH)


def test_custom_model_fn_checkpoint_names_are_the_unwrapped_ones(tmp_path):
  unwrapped_dir, wrapped_dir = str(tmp_path / "unwrapped"), str(tmp_path /
                                                               "wrapped")
  tf.estimator.Estimator(_model_fn, unwrapped_dir,
                         config=_config(1)).train(_custom_input)
  towers = _TowerScopes()
  tf.estimator.Estimator(
      replicate.replicate_model_fn(_model_fn), wrapped_dir,
      config=_config(2)).train(_custom_input, hooks=[towers])
  assert towers.scopes == {"tower_1"}
  # Names and shapes, Adam's slots and powers included, exactly.
  assert tf.train.list_variables(wrapped_dir) == tf.train.list_variables(
      unwrapped_dir)
  names = [name for name, _ in tf.train.list_variables(wrapped_dir)]
  assert {"beta1_power", "color_embedding/Adam", "hidden/kernel/Adam_1",
          "global_step"} <= set(names)
  assert not [name for name in names if "tower" in name]
  # Constant initial values: the same training gives the same variables.
  wrapped = checkpoint_values(wrapped_dir)
  unwrapped = checkpoint_values(unwrapped_dir)
  assert wrapped["global_step"] == unwrapped["global_step"] == STEPS
  for name, value in unwrapped.items():
    np.testing.assert_allclose(wrapped[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
