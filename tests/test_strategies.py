"""One object per variable_strategy, chosen per call of the wrapped model_fn."""

import inspect

import pytest
import tensorflow as tf

from conftest import EVAL, PREDICT, TRAIN, cpus, session_config
from replicate.communication import allreduce
from replicate.variables import strategies

CONFIG = tf.estimator.RunConfig(session_config=session_config(3))


def _for_call(name, mode, towers=3, all_reduce=allreduce.AUTO):
  """(the towers' devices, the strategy object), found as the build does."""
  strategies.check_cluster(name, CONFIG, mode)
  devices = strategies.tower_devices(cpus(towers), CONFIG, mode)
  return devices, strategies.for_call(name, devices, CONFIG, mode,
                                      all_reduce, compact=False)


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


# Every strategy has what the build asks of it: `VariableStrategy`.

_STRATEGY_CLASSES = [strategies.ParameterServer, strategies.RoundRobin,
                     strategies.Replicated, strategies.PsCluster,
                     strategies.SyncCluster, strategies._SharedVariables]


def _protocol_members():
  protocol = strategies.VariableStrategy
  methods = {name for name, value in vars(protocol).items()
             if callable(value) and not name.startswith("_")}
  return set(protocol.__annotations__) | methods, methods


def test_the_protocol_lists_what_the_build_asks():
  members, methods = _protocol_members()
  assert members == {"copies_variables", "cross_task", "variable_device",
                     "combine"}
  assert methods == {"variable_device", "combine"}


@pytest.mark.parametrize("cls", _STRATEGY_CLASSES,
                         ids=lambda cls: cls.__name__)
def test_every_strategy_class_has_every_member_of_the_protocol(cls):
  members, methods = _protocol_members()
  for name in members:
    assert hasattr(cls, name), name  # on the class, not set per instance
  assert isinstance(cls.copies_variables, bool)
  for name in methods:
    expected = inspect.signature(getattr(strategies.VariableStrategy, name))
    assert list(inspect.signature(getattr(cls, name)).parameters) == list(
        expected.parameters), name


@pytest.mark.parametrize("name", strategies.NAMES)
@pytest.mark.parametrize("mode", [TRAIN, EVAL])
def test_for_call_gives_a_variable_strategy(name, mode):
  _, strategy = _for_call(name, mode)
  assert isinstance(strategy, strategies.VariableStrategy)
  assert isinstance(strategies.PsCluster(2, _WorkerConfig()),
                    strategies.VariableStrategy)


def test_an_object_without_combine_is_no_variable_strategy():

  class Incomplete:
    copies_variables = False

    def variable_device(self, op):
      del op

  assert not isinstance(Incomplete(), strategies.VariableStrategy)
