"""SavedModels of every mode load anywhere, as the unwrapped model's do.

`experimental_export_all_saved_models` with TRAIN, EVAL and PREDICT
receivers; each mode's graph is loaded in a fresh process with a session
of one CPU and no soft placement, and run on the same rows as the unwrapped
estimator's export.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import session_config

ROWS = 7  # uneven over 2 (4, 3) and 3 (3, 2, 2) towers
_rng = np.random.RandomState(8)
X = _rng.rand(ROWS, 3).astype(np.float32)
Y = (X.sum(axis=1) > 1.5).astype(np.int64)


def _model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(
      features["x"], 2, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.5, 0.5, 6).reshape(3, 2)))
  predictions = {"probabilities": tf.nn.softmax(logits)}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, predictions=predictions,
      eval_metric_ops={"accuracy": tf.compat.v1.metrics.accuracy(
          labels, tf.argmax(logits, axis=1))})


def _input_fn():
  return tf.data.Dataset.from_tensors(({"x": X}, Y))


# Loads one mode's graph in a default session and runs it on the rows:
# PREDICT's probabilities; EVAL's loss and accuracy after one update of the
# metric; TRAIN's loss, one train step, and the loss after it.
_LOAD = """
import json, sys
import numpy as np
import tensorflow as tf
export_dir, mode, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tags = {"infer": ["serve"], "eval": ["eval"], "train": ["train"]}[mode]
# TensorFlow 2's Session() without a config places softly; this one does not.
strict = tf.compat.v1.ConfigProto(allow_soft_placement=False,
                                  device_count={"CPU": 1})
with tf.compat.v1.Session(graph=tf.Graph(), config=strict) as session:
  graph_def = tf.compat.v1.saved_model.load(session, tags, export_dir)
  signature = next(iter(graph_def.signature_def.values()))
  feed = {signature.inputs[key].name: np.array(rows[key])
          for key in signature.inputs}
  out = lambda key: signature.outputs[key].name
  if mode == "infer":
    result = session.run(out("probabilities"), feed).tolist()
  elif mode == "eval":
    session.run(out("metrics/accuracy/update_op"), feed)
    result = [float(session.run(out("loss"), feed)),
              float(session.run(out("metrics/accuracy/value")))]
  else:
    train_op = tf.compat.v1.get_collection("saved_model_train_op")[0]
    before = float(session.run(out("loss"), feed))
    session.run(train_op, feed)
    result = [before, float(session.run(out("loss"), feed))]
print(json.dumps(result))
"""


def _load_and_run(export_dir, mode):
  rows = {"x": X.tolist(), "label": Y.tolist()}
  loaded = subprocess.run(
      [sys.executable, "-c", _LOAD, export_dir, mode, json.dumps(rows)],
      capture_output=True, text=True, check=False,
      env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2"))
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  return json.loads(loaded.stdout.strip().splitlines()[-1])


def _export_every_mode(model_fn, towers, base):
  estimator = tf.estimator.Estimator(
      model_fn, model_dir=os.path.join(base, "model"),
      config=tf.estimator.RunConfig(session_config=session_config(towers)))
  estimator.train(_input_fn, steps=2)
  supervised = tf.estimator.experimental.build_raw_supervised_input_receiver_fn(
      {"x": tf.constant(X)}, tf.constant(Y))
  serving = tf.estimator.export.build_raw_serving_input_receiver_fn(
      {"x": tf.constant(X)})
  export_dir = estimator.experimental_export_all_saved_models(
      os.path.join(base, "export"), {
          tf.estimator.ModeKeys.TRAIN: supervised,
          tf.estimator.ModeKeys.EVAL: supervised,
          tf.estimator.ModeKeys.PREDICT: serving,
      }).decode()
  return {mode: _load_and_run(export_dir, mode)
          for mode in ("infer", "eval", "train")}


@pytest.fixture(scope="module")
def unwrapped(tmp_path_factory):
  return _export_every_mode(_model_fn, 1, str(tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_every_mode_loads_in_a_fresh_default_session(unwrapped, towers,
                                                     strategy, tmp_path):
  got = _export_every_mode(replicate.replicate_model_fn(
      _model_fn, variable_strategy=strategy), towers, str(tmp_path))
  probabilities = np.array(unwrapped["infer"])
  assert probabilities.shape == (ROWS, 2)
  np.testing.assert_allclose(got["infer"], probabilities, rtol=1e-5)
  np.testing.assert_allclose(got["eval"], unwrapped["eval"], rtol=1e-5)
  before, after = unwrapped["train"]
  assert after < before  # the loaded train_op trains
  np.testing.assert_allclose(got["train"], unwrapped["train"], rtol=1e-5)
