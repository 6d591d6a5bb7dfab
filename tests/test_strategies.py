"""One object per variable_strategy, chosen per call of the wrapped model_fn."""

import pytest
import tensorflow as tf

from conftest import EVAL, PREDICT, TRAIN, cpus, session_config
from replicate.communication import allreduce
from replicate.variables import strategies

CONFIG = tf.estimator.RunConfig(session_config=session_config(3))


def _for_call(name, mode, towers=3, all_reduce=allreduce.AUTO):
  return strategies.for_call(name, cpus(towers), CONFIG, mode, all_reduce,
                             compact=False)


def test_replicated_copies_variables_in_training_with_several_towers():
  tower_devices, strategy = _for_call(strategies.REPLICATED, TRAIN)
  assert len(tower_devices) == 3
  assert isinstance(strategy, strategies.Replicated)
  assert strategy.copies_variables
  assert strategy.algorithm == allreduce.GATHER  # "auto" on CPU towers


@pytest.mark.parametrize("mode, towers", [(EVAL, 3), (PREDICT, 3),
                                          (TRAIN, 1)])
def test_replicated_reads_tower0s_variables_otherwise(mode, towers):
  _, strategy = _for_call(strategies.REPLICATED, mode, towers)
  assert not strategy.copies_variables
  with tf.Graph().as_default():
    op = tf.Variable(1.0).op
  assert strategy.variable_device(op) is None  # with tower 0


@pytest.mark.parametrize("name, expected", [
    (strategies.PARAMETER_SERVER, ["/device:CPU:0"] * 3),
    (strategies.ROUND_ROBIN, cpus(3)),  # devices as given, in turn
])
def test_shared_strategies_place_variables_and_do_not_copy(name, expected):
  _, strategy = _for_call(name, TRAIN)
  assert not strategy.copies_variables
  with tf.Graph().as_default():
    ops = [tf.Variable(1.0, name=n).op for n in "abc"]
  assert [strategy.variable_device(op) for op in ops] == expected


def test_ps_cluster_places_variables_on_ps_tasks_and_sums_on_the_worker():
  strategy = strategies.PsCluster(2, _WorkerConfig())
  with tf.Graph().as_default():
    ops = [tf.Variable(1.0, name=n).op for n in "abc"]
  assert [strategy.variable_device(op) for op in ops] == [
      "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0",
      "/job:ps/task:0/device:CPU:0"]
  assert strategy.sum_device == "/job:worker/task:1/device:CPU:0"
  assert not strategy.copies_variables


class _WorkerConfig:
  task_type = "worker"
  task_id = 1
