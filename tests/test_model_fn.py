"""replicate_model_fn: arguments, device choice, one device, serving, hygiene."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction


def _model_fn(features, labels, mode, params, config):
  del config
  scale = params.get("scale", 1.0) if params else 1.0
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  predictions = w * features * scale
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op,
      eval_metric_ops={"mae": tf.compat.v1.metrics.mean_absolute_error(
          labels, predictions)})


def test_none_reduction_is_refused_when_wrapping():
  with pytest.raises(ValueError, match="none reduction is specified"):
    replicate.replicate_model_fn(_model_fn, loss_reduction=Reduction.NONE)


@pytest.mark.parametrize("kwargs, error, expected", [
    ({"loss_reduction": "average"}, ValueError,
     "loss_reduction must be one of"),
    ({"variable_strategy": "mirrored"}, ValueError,
     "'parameter_server', 'round_robin', 'replicated'. Received: 'mirrored'"),
    ({"variable_strategy": "replicated", "all_reduce": "tree"}, ValueError,
     "all_reduce must be one of 'auto', 'gather', 'ring', 'nccl'. Received: "
     "'tree'"),
    ({"all_reduce": "ring"}, ValueError,
     "apply only with variable_strategy='replicated' \\(received "
     "'parameter_server'\\)"),
    ({"variable_strategy": "round_robin", "compact_gradients": True},
     ValueError, "apply only with variable_strategy='replicated'"),
    ({"variable_strategy": "replicated", "compact_gradients": "yes"},
     ValueError, "compact_gradients must be True or False. Received: 'yes'"),
    ({"devices": ["/gpu:0", "/GPU:0"]}, ValueError, "twice"),
    ({"devices": []}, ValueError, "devices is empty"),
    ({"devices": ["/gpu:0", "gpu/0"]}, ValueError, "'gpu/0'"),
])
def test_bad_arguments_fail_when_wrapping(kwargs, error, expected):
  with pytest.raises(error, match=expected):
    replicate.replicate_model_fn(_model_fn, **kwargs)


def test_one_device_places_the_unchanged_model_fn_there(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=["/cpu:1"])(
      tf.ones([4]), tf.ones([4]), TRAIN)
  names = [op.name for op in graph.get_operations()]
  assert not [n for n in names if n.startswith("tower_")]
  assert not [n for n in names if "split" in n.lower()]  # no sharding
  assert spec.loss.device == "/device:CPU:1"
  w = tf.compat.v1.trainable_variables()[0]
  assert w.device == "/device:CPU:1"


def test_no_devices_means_every_cpu_the_session_config_gives(graph):
  config = tf.estimator.RunConfig(session_config=session_config(3))
  replicate.replicate_model_fn(_model_fn)(
      tf.ones([6]), tf.ones([6]), TRAIN, params={}, config=config)
  devices = {op.device for op in graph.get_operations() if op.device}
  assert {"/device:CPU:0", "/device:CPU:1", "/device:CPU:2"} <= devices
  assert graph.get_operation_by_name("tower_2/mean_squared_error/value")


def test_params_and_config_reach_the_model_fn_that_takes_them(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0]), None, PREDICT, params={"scale": 3.0},
      config=None)
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    np.testing.assert_allclose(session.run(spec.predictions), [3.0, 6.0])


def test_params_or_labels_the_model_fn_cannot_take_are_refused(graph):
  def features_only(features, mode):
    return tf.estimator.EstimatorSpec(mode, predictions=features)

  wrapped = replicate.replicate_model_fn(features_only, devices=cpus(2))
  with pytest.raises(ValueError, match="does not take params"):
    wrapped(tf.ones([2]), None, PREDICT, params={"scale": 2.0})
  with pytest.raises(ValueError, match="does not take labels"):
    wrapped(tf.ones([2]), tf.ones([2]), PREDICT)
  spec = wrapped(tf.ones([2]), None, PREDICT, params={})
  assert spec.predictions.shape.as_list() == [2]


def test_a_model_fn_that_returns_no_estimator_spec_is_named(graph):
  def model_fn(features, labels, mode):
    return features

  with pytest.raises(ValueError, match="tower 0 returned a SymbolicTensor"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([2]), None, PREDICT)


def test_serving_input_builds_one_tower_with_no_device_strings(graph):
  receiver = tf.compat.v1.placeholder(tf.float32, [None], name="input")
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(3))(
      receiver, None, PREDICT, params={})
  assert not [op.name for op in graph.get_operations() if op.device]
  assert not [op.name for op in graph.get_operations()
              if op.name.startswith("tower_")]
  # A default session (one CPU, no soft placement) serves a batch of 1.
  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    assert session.run(spec.predictions, {receiver: [5.0]}).tolist() == [5.0]


def test_prediction_input_from_a_dataset_is_still_split(graph):
  features = tf.compat.v1.data.make_one_shot_iterator(
      tf.data.Dataset.from_tensors(tf.constant([1.0, 2.0, 3.0]))).get_next()
  replicate.replicate_model_fn(_model_fn, devices=cpus(3))(
      features, None, PREDICT, params={})
  assert graph.get_operation_by_name("tower_2/mul")


@pytest.mark.parametrize("mode", [TRAIN, EVAL, PREDICT])
def test_nothing_of_the_wrapper_is_left_in_the_graph(mode):
  def build(model_fn):
    with tf.Graph().as_default() as g:
      tf.compat.v1.train.get_or_create_global_step()
      model_fn(tf.ones([5]), tf.ones([5]), mode, params={}, config=None)
      return g

  unwrapped = build(_model_fn)
  wrapped = build(replicate.replicate_model_fn(_model_fn, devices=cpus(3)))
  assert sorted(wrapped.get_all_collection_keys()) == sorted(
      unwrapped.get_all_collection_keys())
  for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
              tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
    assert [v.op.name for v in wrapped.get_collection(key)] == [
        v.op.name for v in unwrapped.get_collection(key)
    ]
  # Metric variables: one set per tower, nothing else of the wrapper's.
  local = [v.op.name for v in wrapped.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES)]
  assert len(local) == 3 * len(unwrapped.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES))


def test_default_scaffold_initialisation_is_all_training_needs(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0]), tf.constant([3.0, 6.0]), TRAIN, params={})
  scaffold = tf.compat.v1.train.Scaffold()
  scaffold.finalize()
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(scaffold.init_op)
    session.run(scaffold.local_init_op)
    session.run(spec.train_op)
    # mse = mean((w x - y)^2); d/dw = mean(2 (w x - y) x) = (2*-2*1 +
    # 2*-4*2) / 2 = -10; w = 1 - 0.1 * -10 = 2.0
    w = tf.compat.v1.trainable_variables()[0]
    assert session.run(w) == pytest.approx(2.0)
