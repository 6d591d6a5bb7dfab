"""Batch norm by default: exact (`sync_batch_norm=True`) or refused, and
per tower only when asked for, with one INFO line naming the layers.

The real-code case is DeepFM's (lambdaji/tf_repos): contrib's
`batch_norm(updates_collections=None)`, whose moving-average updates run in
place (control dependencies of its output), built twice, for training and
for inference, and picked by `tf.cond(train_phase, ...)`. TF 2.15 has no
contrib, so it is written as its users port it: a
`tf.compat.v1.layers.batch_normalization` or a Keras `BatchNormalization`
whose updates are made control dependencies of the output. On main 2c8ec8c
(default per tower) 2 towers put its variables off one device's by up to
0.3 and its predictions by 0.1, with no word in the log.

Each case: 2 momentum-SGD steps on 7 rows (4 + 3, 3 + 2 + 2 rows),
unwrapped on one device and wrapped on 2 and 3 towers with the default,
from the same seeded initial values; then EVAL (loss, AUC, mean of the
probabilities) and PREDICT on the trained variables. Every variable (the
moving statistics included), metric and prediction must agree to 1e-5.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

FIELDS = 5
ROWS = 7
STEPS = 2


def _init(seed):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _v1_in_place(x, training, scope, reuse):
  """contrib `batch_norm(updates_collections=None)` in TF 2.15 code."""
  with tf.compat.v1.variable_scope(scope, reuse=reuse):
    updates = tf.compat.v1.get_collection_ref(
        tf.compat.v1.GraphKeys.UPDATE_OPS)
    before = len(updates)
    y = tf.compat.v1.layers.batch_normalization(x, momentum=0.9,
                                                training=training)
    in_place = updates[before:]
    del updates[before:]  # not left to the model_fn: applied in place
    with tf.control_dependencies(in_place):
      return tf.identity(y)


def _v1_batch_norm_layer(x, train_phase, scope):
  """DeepFM's `batch_norm_layer`: built twice, picked by `tf.cond`."""
  bn_train = _v1_in_place(x, True, scope, None)
  bn_infer = _v1_in_place(x, False, scope, True)
  return tf.cond(tf.cast(train_phase, tf.bool), lambda: bn_train,
                 lambda: bn_infer)


def _keras_batch_norm_layer(x, train_phase, scope):
  """The same with one Keras layer called twice, updates in place."""
  layer = tf.keras.layers.BatchNormalization(momentum=0.9, name=scope)
  bn_train = layer(x, training=True)
  with tf.control_dependencies(layer.updates):
    bn_train = tf.identity(bn_train)
  bn_infer = layer(x, training=False)
  return tf.cond(tf.cast(train_phase, tf.bool), lambda: bn_train,
                 lambda: bn_infer)


def _deepfm_model_fn(batch_norm_layer):
  def model_fn(features, labels, mode):
    train_phase = mode == TRAIN
    x = features["x"]
    # FM part: first order and pairwise interactions of field embeddings.
    embeddings = tf.compat.v1.get_variable(
        "embeddings", [FIELDS, 3], initializer=_init(1))
    fields = x[:, :, tf.newaxis] * embeddings
    pairs = 0.5 * tf.reduce_sum(
        tf.square(tf.reduce_sum(fields, 1)) -
        tf.reduce_sum(tf.square(fields), 1), 1)
    first = tf.compat.v1.layers.dense(x, 1, kernel_initializer=_init(2),
                                      name="first_order")[:, 0]
    # Deep part: dense - batch norm - relu, twice.
    deep = tf.reshape(fields, [-1, FIELDS * 3])
    for index in range(2):
      deep = tf.compat.v1.layers.dense(deep, 4, kernel_initializer=_init(
          3 + index), name="mlp{}".format(index))
      deep = tf.nn.relu(batch_norm_layer(deep, train_phase,
                                         "bn_{}".format(index)))
    deep = tf.compat.v1.layers.dense(deep, 1, kernel_initializer=_init(5),
                                     name="deep_out")[:, 0]
    logits = first + pairs + deep
    probability = tf.sigmoid(logits)
    predictions = {"prob": probability}
    if mode == PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions=predictions)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=labels, logits=logits))
    if mode == EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
          "auc": tf.compat.v1.metrics.auc(labels, probability),
          "mean_prob": tf.compat.v1.metrics.mean(probability)})
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      predictions=predictions)

  return model_fn


MODELS = {"v1_layers": _deepfm_model_fn(_v1_batch_norm_layer),
          "keras": _deepfm_model_fn(_keras_batch_norm_layer)}


def _data():
  rng = np.random.RandomState(0)
  x = rng.normal(1.0, 2.0, (STEPS * ROWS, FIELDS)).astype(np.float32)
  y = (rng.uniform(size=STEPS * ROWS) < 0.5).astype(np.float32)
  return x, y


def _input(mode):
  """Batches of 7 rows, size unknown to the graph, as an input_fn's."""
  x, y = _data()
  if mode != TRAIN:
    x, y = x[:ROWS], y[:ROWS]
  dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(ROWS)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _run(model_fn, towers, checkpoint, **wrap_kwargs):
  """Train 2 steps, then EVAL and PREDICT from the trained variables."""
  if towers is not None:
    model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                            **wrap_kwargs)
  result = {}
  for mode in (TRAIN, EVAL, PREDICT):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      features, labels = _input(mode)
      spec = model_fn(features=features,
                      labels=None if mode == PREDICT else labels, mode=mode)
      saver = tf.compat.v1.train.Saver()
      with tf.compat.v1.Session(config=session_config(4)) as session:
        session.run(tf.compat.v1.local_variables_initializer())
        if mode == TRAIN:
          session.run(tf.compat.v1.global_variables_initializer())
          for _ in range(STEPS):
            session.run(spec.train_op)
          saver.save(session, checkpoint)
          result["variables"] = {v.op.name: session.run(v)
                                 for v in tf.compat.v1.global_variables()}
        elif mode == EVAL:
          saver.restore(session, checkpoint)
          _, loss = session.run([[update for _, update in
                                  spec.eval_metric_ops.values()], spec.loss])
          result["metrics"] = session.run(
              {name: value for name, (value, _) in
               spec.eval_metric_ops.items()})
          result["metrics"]["loss"] = loss
        else:
          saver.restore(session, checkpoint)
          result["predictions"] = session.run(spec.predictions["prob"])
  return result


def _differences(expected, actual):
  """Max |difference| over variables, metrics and predictions."""
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
  return {
      "variables": max(diff(actual["variables"][name], value)
                       for name, value in expected["variables"].items()),
      "moving": max(diff(actual["variables"][name], value)
                    for name, value in expected["variables"].items()
                    if "moving_" in name),
      "metrics": max(diff(actual["metrics"][name], value)
                     for name, value in expected["metrics"].items()),
      "predictions": diff(actual["predictions"], expected["predictions"])}


_UNWRAPPED = {}


def _unwrapped(model, tmp_path_factory):
  if model not in _UNWRAPPED:
    _UNWRAPPED[model] = _run(MODELS[model], None, str(
        tmp_path_factory.mktemp("unwrapped") / "model.ckpt"))
  return _UNWRAPPED[model]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("towers", [2, 3])
def test_deepfm_in_place_batch_norm_is_one_device_by_default(
    model, towers, tmp_path, tmp_path_factory):
  expected = _unwrapped(model, tmp_path_factory)
  actual = _run(MODELS[model], towers, str(tmp_path / "model.ckpt"))
  # The in-place updates ran: every moving mean has moved from 0.
  moving = [value for name, value in expected["variables"].items()
            if name.endswith("moving_mean")]
  assert len(moving) == 2 and all(np.abs(m).max() > 1e-3 for m in moving)
  differences = _differences(expected, actual)
  assert max(differences.values()) < 1e-5, differences


_Lines = harness.LogLines


def _batch_norm_lines(lines):
  return [line for line in lines if "batch-norm" in line]


def test_per_tower_only_when_asked_for_and_then_said(tmp_path,
                                                     tmp_path_factory):
  expected = _unwrapped("v1_layers", tmp_path_factory)
  with _Lines() as lines:
    actual = _run(MODELS["v1_layers"], 2, str(tmp_path / "model.ckpt"),
                  sync_batch_norm=False)
  # What the default was on 2c8ec8c: far from one device, in silence.
  differences = _differences(expected, actual)
  assert differences["moving"] > 0.01 and differences["predictions"] > 0.01, (
      differences)
  # One line for the TRAIN call (EVAL and PREDICT normalize with the moving
  # statistics), naming tower 0's layers.
  assert _batch_norm_lines(lines) == [
      "replicate: sync_batch_norm=False: 2 batch-norm layers normalized per "
      "tower, each of the 2 towers with its own shard's moments (not one "
      "device's; sync_batch_norm=True, the default, uses the whole "
      "batch's): 'bn_0/batch_normalization', 'bn_1/batch_normalization'."]


def _dense_model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(features["x"], 1,
                                     kernel_initializer=_init(1))[:, 0]
  loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
      labels=labels, logits=logits))
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    predictions={"logits": logits})


def _graph(model_fn, mode=TRAIN, devices=cpus(2), serving=False,
           **wrap_kwargs):
  """(op name, op type, input names) of the wrapped model_fn's graph."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    if serving:
      features = {"x": tf.compat.v1.placeholder(tf.float32, [None, FIELDS])}
      labels = None
    else:
      features, labels = _input(mode)
    replicate.replicate_model_fn(model_fn, devices=devices, **wrap_kwargs)(
        features=features, labels=None if mode == PREDICT else labels,
        mode=mode)
  return [(op.name, op.type, [t.name for t in op.inputs])
          for op in graph.get_operations()]


def test_a_model_without_batch_norm_builds_the_same_graph_and_logs_nothing():
  with _Lines() as lines:
    default = _graph(_dense_model_fn)
  assert default == _graph(_dense_model_fn, sync_batch_norm=False)
  assert _batch_norm_lines(lines) == []
  with _Lines() as lines:
    _graph(_dense_model_fn, sync_batch_norm=False)
  assert _batch_norm_lines(lines) == []


@pytest.mark.parametrize("where", ["one_device", "eval", "predict", "export"])
def test_one_device_evaluation_prediction_and_export_are_untouched(where):
  kwargs = {"one_device": dict(devices=cpus(1)), "eval": dict(mode=EVAL),
            "predict": dict(mode=PREDICT),
            "export": dict(mode=PREDICT, serving=True)}[where]
  model_fn = MODELS["v1_layers"]
  with _Lines() as lines:
    default = _graph(model_fn, **kwargs)
  assert default == _graph(model_fn, sync_batch_norm=False, **kwargs)
  assert _batch_norm_lines(lines) == []


# Keras's LayerNormalization computes a layer norm with the fused batch-norm
# kernel on a [1, rows x ..., width, 1] reshape: each row's own statistics,
# nothing to synchronize. Taken for a batch norm, 8 rows trained off one
# device (loss 2.0345 against 2.0591) and 5 rows (3 + 2) failed to build.
@pytest.mark.parametrize("rows", [8, 5])
def test_keras_layer_normalization_is_not_a_batch_norm(rows, caplog):
  rng = np.random.RandomState(0)
  x = rng.randn(rows, 3, 4).astype(np.float32)
  y = rng.randn(rows, 3, 4).astype(np.float32)

  def model_fn(features, labels, mode):
    normalized = tf.keras.layers.LayerNormalization()(features)  # fused
    loss = tf.reduce_mean(tf.square(normalized - labels))
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(
        loss, tf.compat.v1.train.get_or_create_global_step()))

  def one_step(fn):
    with tf.Graph().as_default():
      spec = fn(tf.constant(x), tf.constant(y), TRAIN)
      with tf.compat.v1.Session(config=session_config(2)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        loss, _ = session.run([spec.loss, spec.train_op])
        return loss, session.run(tf.compat.v1.trainable_variables())

  unwrapped_loss, unwrapped = one_step(model_fn)
  with caplog.at_level(logging.INFO):
    wrapped_loss, wrapped = one_step(replicate.replicate_model_fn(
        model_fn, devices=cpus(2), sync_batch_norm=False))
  default_loss, default = one_step(
      replicate.replicate_model_fn(model_fn, devices=cpus(2)))
  # Keras's gamma and beta start at 1 and 0; one step moves them.
  assert len(unwrapped) == 2
  for loss, variables in ((wrapped_loss, wrapped), (default_loss, default)):
    np.testing.assert_allclose(loss, unwrapped_loss, rtol=1e-5)
    for value, expected in zip(variables, unwrapped):
      np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
  assert "normalized per tower" not in caplog.text
