"""The replication context: scoped, per graph, and gone afterwards."""

import dataclasses

import pytest
import tensorflow as tf

from conftest import cpus, replication_context, run_initialized
from replicate.shard import sharding
from replicate.call import layout as layout_lib
from replicate.call import current
from replicate.variables import strategies


def _context(graph, count=2):
  return replication_context(graph, count)


def test_context_exists_only_while_towers_are_built(graph):
  keys_before = set(graph.get_all_collection_keys())
  assert current.current_context() is None
  with _context(graph) as context:
    assert current.current_context() is context
    with tf.Graph().as_default():  # another graph does not see it
      assert current.current_context() is None
  assert current.current_context() is None
  assert not graph.get_collection(current._COLLECTION)
  assert set(graph.get_all_collection_keys()) <= keys_before | {
      current._COLLECTION
  }


def test_context_is_cleared_when_a_tower_raises(graph):
  with pytest.raises(RuntimeError, match="model_fn failed"):
    with _context(graph) as context:
      with context.tower_scope(0):
        raise RuntimeError("model_fn failed")
  assert current.current_context() is None


def test_nested_contexts_are_refused(graph):
  with _context(graph):
    with pytest.raises(ValueError, match="nested replicate_model_fn"):
      with _context(graph):
        pass


def test_towers_get_name_scopes_devices_and_tower_0s_variables(graph):
  ops, kernels = [], []
  with _context(graph, 3) as context:
    for index in range(3):
      with context.tower_scope(index):
        assert context.progress.tower_index == index
        ops.append(tf.identity(1.0, name="x"))
        # Unnamed layers and default-named scopes resolve to tower 0's.
        tf.compat.v1.layers.dense(tf.ones([1, 2]), 1)
        with tf.compat.v1.variable_scope(None, default_name="block"):
          kernels.append(tf.compat.v1.get_variable("w", []))
    context.finish_towers()
  assert [op.name for op in ops] == ["x:0", "tower_1/x:0", "tower_2/x:0"]
  assert [op.device for op in ops] == ["/cpu:0", "/cpu:1", "/cpu:2"]
  assert kernels[0] is kernels[1] is kernels[2]
  names = sorted(v.op.name for v in tf.compat.v1.global_variables())
  assert names == ["block/w", "dense/bias", "dense/kernel", "global_step"]
  # After the towers, default names continue as after the unwrapped model_fn.
  with tf.compat.v1.variable_scope(None, default_name="block") as scope:
    assert scope.name == "block_1"


def test_get_total_loss_in_a_tower_sees_that_towers_losses_only(graph):
  totals = []
  with _context(graph) as context:
    for index in range(2):
      with context.tower_scope(index):
        tf.compat.v1.losses.add_loss(tf.constant(float(index + 1)))
        totals.append(tf.compat.v1.losses.get_total_loss(
            add_regularization_losses=False))
    context.finish_towers()
  assert run_initialized(totals) == [1.0, 2.0]
  # Afterwards the collection holds what the unwrapped model_fn leaves.
  assert len(tf.compat.v1.losses.get_losses()) == 1


def test_tower0_name_strips_only_the_tower_prefix():
  to_tower0_name = layout_lib.to_tower0_name
  assert to_tower0_name("tower_2/accuracy/total", 2) == "accuracy/total"
  assert to_tower0_name("tower_20/x", 2) == "tower_20/x"
  assert to_tower0_name("tower_2/dnn/tower_2/input_layer/w", 2) == (
      "dnn/input_layer/w")
  assert to_tower0_name("accuracy/total", 0) == "accuracy/total"


def test_the_layout_holds_one_record_per_tower(graph):
  features = {"x": tf.constant([[1.0], [2.0]])}
  labels = tf.constant([10, 20])
  shards = sharding.split_batch(features, labels, 3)  # 1, 1 and 0 rows
  functions = [lambda op, d=d: d for d in cpus(3)]
  strategy = strategies.ParameterServer(cpus(3))
  layout = layout_lib.TowerLayout.of(cpus(3), functions, shards, strategy)
  assert [t.index for t in layout.towers] == [0, 1, 2]
  assert [t.device for t in layout.towers] == cpus(3)
  assert [t.device_function for t in layout.towers] == functions
  assert [t.features for t in layout.towers] == shards.features
  assert [t.labels for t in layout.towers] == shards.labels
  assert [t.share for t in layout.towers] == [0.5, 0.5, 0.0]
  assert [t.has_rows for t in layout.towers] == [True, True, False]
  assert layout.has_rows == [True, True, False]
  assert layout.devices == cpus(3) and layout.num_towers == 3
  assert layout.shards is shards and layout.strategy is strategy
  assert layout.graph is graph and not layout.is_replicated
  with tf.compat.v1.Session() as session:
    assert session.run([t.features["x"] for t in layout.towers[:2]] +
                       [layout.towers[1].labels]) == [[[1.0]], [[2.0]], [20]]
  with pytest.raises(dataclasses.FrozenInstanceError):
    layout.towers[0].device = "/cpu:3"


def test_a_batch_known_at_run_time_gives_tensor_shares_and_rows(graph):
  batch = tf.compat.v1.placeholder(tf.float32, [None, 1])
  shards = sharding.split_batch(batch, None, 2)
  layout = layout_lib.TowerLayout.of(
      cpus(2), [lambda op: None] * 2, shards,
      strategies.ParameterServer(cpus(2)))
  with tf.compat.v1.Session() as session:
    assert session.run([(t.share, t.has_rows) for t in layout.towers],
                       {batch: [[1.0]]}) == [(1.0, True), (0.0, False)]
