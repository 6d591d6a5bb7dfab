"""The one rule for state (`replicate/state/rule.py`), one class a test.

Every stateful op of a tower's step is `allowed` (changes nothing that
outlives the step), `keep` (every tower's changes add up over the batch),
`once` (tower 0's, the others change nothing), `statistic` (the towers'
values combined by their share of the batch), or refused with a
`ValueError` naming the op and the fix. Each test builds two towers on a
batch of two rows and reads what the rule says of tower 1's op; the last
ones train a model_fn and compare it with one device.
"""

from typing import NamedTuple

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from conftest import replication_context
from replicate.state import rule

Aggregation = tf.VariableAggregation


class _Spec(NamedTuple):
  train_op: tf.Operation
  loss: tf.Tensor


def _kinds(graph, build):
  """{variable name, else op type: kind} of tower 1's stateful ops.

  `build(x)` is called in each tower with the tower's rows [1, 1] and
  returns the op its train_op waits for.
  """
  with replication_context(graph, 2) as context:
    specs = []
    for tower in context.layout.towers:
      with context.tower_scope(tower.index):
        x = tower.features
        specs.append(_Spec(tf.group(build(x)), tf.reduce_sum(x)))
    context.finish_towers()
    classes = rule.classify(context.layout, context.progress,
                            context.variables, specs)
  return {(change.variable.op.name if change.variable is not None else
           change.op.type): change.kind for change in classes[1]}


def _variable(name, aggregation=Aggregation.NONE, value=0.0):
  return tf.compat.v1.get_variable(
      name, [], trainable=False, aggregation=aggregation,
      initializer=tf.compat.v1.constant_initializer(value),
      use_resource=True)


def test_a_read_or_a_random_number_is_allowed(graph):
  kinds = _kinds(graph, lambda x: [tf.random.uniform([1]) + x])
  assert set(kinds.values()) <= {rule.ALLOWED}
  assert kinds.get("RandomUniform") == rule.ALLOWED


def _moving_average_in_update_ops(x):
  moving = _variable("v")
  update = moving.assign(0.9 * moving + 0.1 * tf.reduce_mean(x))
  tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
  return update


# (what tower 1 does to the variable "v", the class the rule gives it)
_CLASSES = {
    "an addition computed from the rows is kept": (
        lambda x: _variable("v").assign_add(tf.reduce_sum(x)), rule.KEEP),
    "a variable declared SUM is kept": (
        lambda x: _variable("v", Aggregation.SUM).assign_add(
            tf.reduce_sum(x)), rule.KEEP),
    "a change not from the rows is made once": (
        lambda x: _variable("v").assign_add(1.0), rule.ONCE),
    "a variable declared ONLY_FIRST_REPLICA is written once": (
        lambda x: _variable("v", Aggregation.ONLY_FIRST_REPLICA).assign(
            tf.reduce_sum(x)), rule.ONCE),
    "a variable declared MEAN is a statistic": (
        lambda x: _variable("v", Aggregation.MEAN).assign(tf.reduce_mean(x)),
        rule.STATISTIC),
    "an assignment from the rows in UPDATE_OPS is a statistic": (
        _moving_average_in_update_ops, rule.STATISTIC),
}


@pytest.mark.parametrize("case", sorted(_CLASSES))
def test_the_class_of_a_change(graph, case):
  build, kind = _CLASSES[case]
  assert _kinds(graph, build)["v"] == kind


def test_an_undeclared_assignment_from_the_rows_is_refused_with_the_fix(
    graph):
  def build(x):
    last = _variable("last_seen")
    return last.assign(tf.reduce_sum(x))
  with pytest.raises(ValueError, match=r"Tower 1's op .*'last_seen'.*"
                     r"aggregation=tf.VariableAggregation.MEAN"):
    _kinds(graph, build)


def test_an_assignment_to_a_variable_declared_sum_is_refused(graph):
  def build(x):
    total = _variable("total", Aggregation.SUM)
    return total.assign(tf.reduce_sum(x))
  with pytest.raises(ValueError, match="declared aggregation=SUM.*assign_add"):
    _kinds(graph, build)


def test_an_unknown_stateful_op_is_refused(graph):
  def build(x):
    queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[[1]])
    return queue.enqueue(x[0])
  with pytest.raises(ValueError, match="stateful FIFOQueueV2 that replicate "
                     "does not know how to combine.*outside the train_op"):
    _kinds(graph, build)


# The classes in training: each gives one device's value on the batch.

def _counting_model_fn(features, labels, mode):
  """A regression that counts its rows (keep), its steps (once) and keeps a
  mean of its inputs (statistic)."""
  w = tf.compat.v1.get_variable("w", [3, 1],
                                initializer=tf.ones_initializer())
  loss = tf.compat.v1.losses.mean_squared_error(labels, features["x"] @ w)
  rows = _variable("rows")
  steps = _variable("steps")
  mean = _variable("x_mean", Aggregation.MEAN)
  train_op = tf.group(
      replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
              loss, global_step=tf.compat.v1.train.get_global_step()),
      rows.assign_add(tf.cast(tf.shape(features["x"])[0], tf.float32)),
      steps.assign_add(1.0),
      mean.assign(tf.reduce_mean(features["x"])))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [2, 3])
def test_kept_once_and_statistic_changes_train_like_one_device(towers):
  rng = np.random.RandomState(0)
  batches = [(rng.rand(7, 3).astype(np.float32),
              rng.rand(7, 1).astype(np.float32)) for _ in range(3)]
  expected, actual = harness.train_both(_counting_model_fn, towers, batches)
  assert actual.variables["rows"] == expected.variables["rows"] == 21.0
  assert actual.variables["steps"] == expected.variables["steps"] == 3.0
  np.testing.assert_allclose(actual.variables["x_mean"],
                             batches[-1][0].mean(), rtol=1e-6)
  assert sorted(actual.variables) == sorted(expected.variables)
  harness.assert_trained_alike(expected, actual)
