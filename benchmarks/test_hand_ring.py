"""Tests of `benchmarks.hand_ring`: the ring built from graph ops.

It left the library for the benchmarks, so it is tested here (tests/ never
imports benchmarks/): it sums like `gather`, by the ring's hops, and
`replicate-N-handring` trains through it exactly as `gather` trains.
"""

import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402
from benchmarks import configs, hand_ring, harness  # noqa: E402
from replicate.communication import allreduce  # noqa: E402

CPUS = ["/device:CPU:{}".format(i) for i in range(3)]


def _session_config():
  return tf.compat.v1.ConfigProto(device_count={"CPU": 3})


def _ring_adds(graph):
  return [op for op in graph.get_operations() if op.type in ("AddV2", "Add")]


def test_the_hand_ring_sums_on_every_device_chunk_by_chunk():
  values = [np.arange(37, dtype=np.float32) * (i + 1) for i in range(3)]
  with tf.Graph().as_default() as graph:
    tensors = []
    for value, device in zip(values, CPUS):
      with tf.device(device):
        tensors.append(tf.constant(value))
    summed = hand_ring.reduce(tensors, CPUS)
    # 37 floats in 3 chunks (13, 12, 12); each chunk is added on the 2
    # devices after the one it starts on: 3 x 2 additions.
    adds = _ring_adds(graph)
    assert sorted(op.outputs[0].shape.as_list()[0] for op in adds) == [
        12, 12, 12, 12, 13, 13]
    assert {op.device for op in adds} == set(CPUS)
    assert not [op for op in graph.get_operations() if op.type == "AddN"]
    assert [t.device for t in summed] == CPUS
    with tf.compat.v1.Session(config=_session_config()) as session:
      for result in session.run(summed):
        np.testing.assert_array_equal(result, sum(values))


def test_a_shape_known_only_at_run_time_is_summed_as_gather():
  with tf.Graph().as_default() as graph:
    tensors = []
    for device in CPUS:
      with tf.device(device):
        tensors.append(tf.compat.v1.placeholder_with_default(
            tf.ones([4]), [None]))
    summed = hand_ring.reduce(tensors, CPUS)
    assert [op.type for op in graph.get_operations()].count("AddN") == 1
    assert not _ring_adds(graph)
    with tf.compat.v1.Session(config=_session_config()) as session:
      for result in session.run(summed):
        np.testing.assert_array_equal(result, [3.0] * 4)


def test_only_handring_configurations_go_through_the_hand_ring():
  config = configs.parse_config("replicate-4-handring")
  assert config.uses_hand_ring
  assert config.replicate_arguments == {"variable_strategy": "replicated",
                                        "all_reduce": "gather",
                                        "sync_batch_norm": False}
  assert config.replicate_arguments["all_reduce"] in allreduce.ALGORITHMS
  for name in ("replicate-4-gather", "replicate-4-ring", "single",
               "mirrored-2-default"):
    assert not configs.parse_config(name).uses_hand_ring


_INITIAL = np.random.RandomState(1).uniform(-1, 1, size=(3, 8)).astype(
    np.float32)


def _model_fn(features, labels, mode):
  # Fixed initial values: both trainings start alike.
  hidden = tf.compat.v1.layers.dense(
      features["x"], 8, activation=tf.nn.relu,
      kernel_initializer=tf.compat.v1.constant_initializer(_INITIAL))
  predictions = tf.compat.v1.layers.dense(
      hidden, 1, kernel_initializer=tf.compat.v1.constant_initializer(
          _INITIAL[0]))
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn():
  rng = np.random.RandomState(0)
  x = rng.rand(7, 3).astype(np.float32)  # 3 towers: 3, 2 and 2 rows
  y = x.sum(axis=1, keepdims=True)
  return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()


def _trained(model_fn, model_dir):
  estimator = tf.estimator.Estimator(
      model_fn, model_dir=str(model_dir), config=tf.estimator.RunConfig(
          session_config=_session_config()))
  estimator.train(_input_fn, steps=3)
  return {name: estimator.get_variable_value(name)
          for name in estimator.get_variable_names()}


def test_a_handring_model_fn_trains_as_gather_through_the_estimator(
    tmp_path):
  gather = replicate.replicate_model_fn(_model_fn, devices=CPUS,
                                        **hand_ring.ARGUMENTS)
  expected = _trained(gather, tmp_path / "gather")
  graphs = []

  def recording(features, labels, mode, config=None):
    graphs.append(tf.compat.v1.get_default_graph())
    return gather(features, labels, mode, config=config)

  got = _trained(hand_ring.with_hand_ring(recording), tmp_path / "handring")
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
  assert np.abs(got["dense/kernel/Adam"]).max() > 0  # gradients were summed
  # The ring's hops were built, and no gather sum for the packed gradients.
  ops = graphs[0].get_operations()
  assert [op for op in ops if op.type == "AddV2" and
          "packed_all_reduce" in op.name]
  assert not [op for op in ops if op.type == "AddN" and
              "packed_all_reduce" in op.name]


def test_the_replacement_holds_only_while_the_model_fn_builds():
  model_fn = hand_ring.with_hand_ring(replicate.replicate_model_fn(
      _model_fn, devices=CPUS, **hand_ring.ARGUMENTS))
  # What the Estimator reads to decide what to pass.
  assert list(inspect.signature(model_fn).parameters) == [
      "features", "labels", "mode", "config"]
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    model_fn({"x": tf.ones([3, 3])}, tf.ones([3, 1]),
             tf.estimator.ModeKeys.TRAIN)
  with tf.Graph().as_default() as graph:
    tensors = []
    for device in CPUS:
      with tf.device(device):
        tensors.append(tf.ones([4]))
    allreduce.all_reduce_grads([[t] for t in tensors], CPUS, allreduce.GATHER)
    assert [op.type for op in graph.get_operations()].count("AddN") == 1
    assert not _ring_adds(graph)


@pytest.mark.parametrize("variant, wrapped", [("handring", 1), ("gather", 0)])
def test_the_harness_wraps_handring_configurations(variant, wrapped,
                                                   monkeypatch):
  calls = []

  def recording(model_fn):
    calls.append(model_fn)
    return model_fn

  monkeypatch.setattr(hand_ring, "with_hand_ring", recording)
  harness.build("mlp", configs.parse_config("replicate-2-" + variant))
  assert len(calls) == wrapped
