"""The one train_op: tower 0's, the towers' own-row changes, UPDATE_OPS once."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, run_initialized, session_config

GraphKeys = tf.compat.v1.GraphKeys


def _statistic_model_fn(write):
  """A linear model whose UPDATE_OPS write a statistic of the rows."""

  def model_fn(features, labels, mode):
    del labels
    statistic = tf.compat.v1.get_variable(
        "statistic", [], trainable=False,
        initializer=tf.compat.v1.constant_initializer(10.0))
    w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
    rows_mean = tf.reduce_mean(features["x"])
    tf.compat.v1.add_to_collection(GraphKeys.UPDATE_OPS,
                                   write(statistic, rows_mean))
    loss = tf.reduce_mean(features["x"] * w)
    with tf.control_dependencies(
        tf.compat.v1.get_collection(GraphKeys.UPDATE_OPS)):
      train_op = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


WRITES = {
    # statistic <- 0.5 * statistic + 0.5 * mean: after one step on rows
    # 0..6 (mean 3), 0.5 * 10 + 0.5 * 3 = 6.5, however it is written.
    "assign": lambda s, m: s.assign(0.5 * s + 0.5 * m),
    "assign_sub": lambda s, m: s.assign_sub(0.5 * (s - m)),
    "ref assign_add": lambda s, m: tf.compat.v1.assign_add(s, 0.5 * (m - s)),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("towers", [2, 3])
def test_update_ops_write_the_rows_weighted_value_once(graph, towers, write):
  x = tf.constant(np.arange(7, dtype=np.float32).reshape(7, 1))
  spec = replicate.replicate_model_fn(
      _statistic_model_fn(WRITES[write]), devices=cpus(towers))(
          {"x": x}, None, TRAIN)
  statistic = tf.compat.v1.global_variables()[1]
  assert statistic.op.name == "statistic"
  with tf.control_dependencies([spec.train_op]):
    after = tf.identity(statistic.read_value())
  assert run_initialized(after) == pytest.approx(6.5)


def test_update_ops_that_differ_between_towers_are_refused(graph):
  calls = []

  def write(statistic, mean):
    calls.append(None)
    return statistic.assign(mean) if len(calls) == 1 else tf.no_op()

  with pytest.raises(ValueError, match="step updates the statistics"):
    replicate.replicate_model_fn(_statistic_model_fn(write), devices=cpus(2))(
        {"x": tf.ones([4, 1])}, None, TRAIN)


def test_update_ops_inside_control_flow_are_refused(graph):
  # A v1 while loop: the write is built inside its control-flow context.
  def model_fn(features, labels, mode):
    del labels
    statistic = tf.compat.v1.get_variable(
        "statistic", [], trainable=False, initializer=tf.zeros_initializer())
    w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())

    def body(i):
      update = statistic.assign(tf.reduce_mean(features["x"]))
      tf.compat.v1.add_to_collection(GraphKeys.UPDATE_OPS, update.op)
      with tf.control_dependencies([update]):
        return i + 1

    # The loop runs with the step (the loss waits for it); one that nothing
    # runs changes no state, wrapped or not.
    done = tf.compat.v1.while_loop(lambda i: i < 1, body, [0])
    with tf.control_dependencies([done]):
      loss = tf.reduce_mean(features["x"] * w)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  tf.compat.v1.disable_control_flow_v2()
  try:
    with pytest.raises(ValueError, match="inside control flow"):
      replicate.replicate_model_fn(model_fn, devices=cpus(2))(
          {"x": tf.ones([4, 1])}, None, TRAIN)
  finally:
    tf.compat.v1.enable_control_flow_v2()


def test_tower_local_writes_run_in_every_tower(graph):
  # A per-tower step count in a tower_local_scope: each tower adds 1, and
  # the fold sums them: 3 a step on 3 towers, as the scope promises.
  def model_fn(features, labels, mode):
    del labels
    with replicate.tower_local_scope(reduce="sum"):
      tower_steps = tf.compat.v1.get_variable(
          "tower_steps", [], trainable=False,
          initializer=tf.zeros_initializer())
    w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
    loss = tf.reduce_mean(features["x"] * w)
    train_op = tf.group(
        replicate.TowerOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(loss),
        tower_steps.assign_add(1.0))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      {"x": tf.ones([6, 1])}, None, TRAIN)
  tower_steps = [v for v in tf.compat.v1.global_variables()
                 if v.op.name == "tower_steps"][0]
  with tf.compat.v1.Session(config=session_config()) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(tf.compat.v1.local_variables_initializer())  # the copies
    for _ in range(2):
      session.run(spec.train_op)
    assert session.run(tower_steps) == pytest.approx(6.0)  # 2 steps x 3
