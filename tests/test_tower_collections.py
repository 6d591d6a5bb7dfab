"""What towers see of LOSSES, REGULARIZATION_LOSSES and UPDATE_OPS."""

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import replication_context, run_initialized

Reduction = tf.compat.v1.losses.Reduction
GraphKeys = tf.compat.v1.GraphKeys


def _context(graph, count, reduction=Reduction.MEAN):
  return replication_context(graph, count, reduction)


def _regularized_kernel():
  return tf.compat.v1.get_variable(
      "kernel", [2], initializer=tf.compat.v1.constant_initializer(3.0),
      regularizer=lambda w: tf.reduce_sum(w * w))


@pytest.mark.parametrize("reduction,later_towers_see", [
    (Reduction.MEAN, 18.0),  # 3^2 + 3^2, weighted by each tower's share
    (Reduction.SUM, 0.0),  # summed as they are: counted in tower 0 only
])
def test_every_tower_sees_tower0s_regularization(graph, reduction,
                                                 later_towers_see):
  seen = []
  with _context(graph, 3, reduction) as context:
    for index in range(3):
      with context.tower_scope(index):
        _regularized_kernel()
        seen.append(tf.compat.v1.losses.get_regularization_loss())
    context.finish_towers()
  assert run_initialized(seen) == [18.0, later_towers_see, later_towers_see]
  assert len(tf.compat.v1.losses.get_regularization_losses()) == 1


def test_regularization_a_later_tower_adds_itself_is_left_out(graph):
  # With "replicated", a layer regularises the tower's copy again; the
  # tower must still count one regularization, tower 0's.
  seen = []
  with _context(graph, 2) as context:
    for index in range(2):
      with context.tower_scope(index):
        kernel = _regularized_kernel()
        tf.compat.v1.add_to_collection(GraphKeys.REGULARIZATION_LOSSES,
                                       tf.reduce_sum(kernel) * 100.0)
        seen.append(tf.compat.v1.losses.get_regularization_loss())
    context.finish_towers()
  assert run_initialized(seen) == [18.0 + 600.0, 18.0 + 600.0]
  assert len(tf.compat.v1.losses.get_regularization_losses()) == 2


def test_each_tower_sees_its_own_update_ops(graph):
  seen = []
  with _context(graph, 3) as context:
    for index in range(3):
      with context.tower_scope(index):
        tf.compat.v1.add_to_collection(GraphKeys.UPDATE_OPS,
                                       tf.no_op(name="update"))
        seen.append([op.name for op in
                     tf.compat.v1.get_collection(GraphKeys.UPDATE_OPS)])
    context.finish_towers()
    assert [op.name for op in context.collections.update_ops(2)] == [
        "tower_2/update"]
  assert seen == [["update"], ["tower_1/update"], ["tower_2/update"]]
  assert [op.name for op in tf.compat.v1.get_collection(
      GraphKeys.UPDATE_OPS)] == ["update"]


def test_collections_held_before_the_model_fn_are_kept(graph):
  before = tf.no_op(name="before")
  tf.compat.v1.add_to_collection(GraphKeys.UPDATE_OPS, before)
  with _context(graph, 2) as context:
    for index in range(2):
      with context.tower_scope(index):
        tf.compat.v1.add_to_collection(GraphKeys.UPDATE_OPS,
                                       tf.no_op(name="update"))
        assert tf.compat.v1.get_collection(GraphKeys.UPDATE_OPS)[0] is before
    context.finish_towers()
  assert [op.name for op in tf.compat.v1.get_collection(
      GraphKeys.UPDATE_OPS)] == ["before", "update"]


def test_collections_are_plain_again_when_a_tower_raises(graph):
  with pytest.raises(RuntimeError, match="model_fn failed"):
    with _context(graph, 2) as context:
      with context.tower_scope(0):
        _regularized_kernel()
      with context.tower_scope(1):
        raise RuntimeError("model_fn failed")
  collection = graph.get_collection_ref(GraphKeys.REGULARIZATION_LOSSES)
  assert type(collection) is list  # pylint: disable=unidiomatic-typecheck
  tf.compat.v1.add_to_collection(GraphKeys.REGULARIZATION_LOSSES,
                                 tf.constant(1.0))
  assert len(graph.get_collection(GraphKeys.REGULARIZATION_LOSSES)) == 2


def _seen_model_fn(seen):
  """A model_fn that records, at four points, the names it sees in the
  variable collections; each call (tower) appends one list."""

  def names():
    return {key: [v.op.name for v in tf.compat.v1.get_collection(key)]
            for key in (GraphKeys.GLOBAL_VARIABLES,
                        GraphKeys.TRAINABLE_VARIABLES,
                        GraphKeys.MOVING_AVERAGE_VARIABLES)}

  def model_fn(features, labels, mode):
    points = [names()]
    seen.append(points)
    hidden = tf.compat.v1.layers.dense(features["x"], 3, name="first")
    points.append(names())
    predictions = tf.compat.v1.layers.dense(hidden, 1, name="second")
    loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
            loss, tf.compat.v1.train.get_global_step())
    points.append(names())  # Adam's slots and beta powers: tower 0's update
    ema = tf.compat.v1.train.ExponentialMovingAverage(0.5)
    with tf.control_dependencies([train_op]):
      train_op = ema.apply(tf.compat.v1.trainable_variables())
    points.append(names())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize("strategy", ["parameter_server", "replicated"])
def test_each_tower_sees_the_variable_collections_tower0_saw(strategy):
  # Seen whole, tower 1's collections at its start would hold all 19 of
  # tower 0's variables (its averages and Adam's slots too).
  rng = np.random.RandomState(0)
  batch = (rng.rand(5, 2).astype(np.float32),
           rng.rand(5, 1).astype(np.float32))
  one, wrapped = [], []
  harness.train(_seen_model_fn(one), [batch])
  harness.train(_seen_model_fn(wrapped), [batch], 3,
                variable_strategy=strategy)
  assert len(wrapped) == 3
  assert wrapped[1] == wrapped[2] == wrapped[0] == one[0]
  global_variables = [p[GraphKeys.GLOBAL_VARIABLES] for p in one[0]]
  assert [len(names) for names in global_variables] == [1, 3, 15, 19]
