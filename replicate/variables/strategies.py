"""One small object per `variable_strategy`: where variables live, what a
tower sees of them, and how the towers' gradients become the update.

| strategy | a variable goes | tower i sees | the towers' gradients |
| --- | --- | --- | --- |
| `ParameterServer` | on the one device, or `/device:CPU:0` with several | tower 0's variable | summed with the variable |
| `RoundRobin` | on the tower devices in turn, in creation order | tower 0's variable | summed with the variable |
| `Replicated` | with tower 0; tower i's copy on tower i | its own copy of each trainable variable | all-reduced: every copy gets the sum |
| `PsCluster` | on the ps tasks in turn | tower 0's variable | summed on this worker's CPU, one update sent |
| `SyncCluster` | as `Replicated`, on this task | as `Replicated` | summed on this task, then across tasks (`replicate.cluster.sync_cluster`) |

`for_call` picks the object for one call of the wrapped `model_fn`, from
the `variable_strategy` name, the mode and the `RunConfig`; everything else
asks the object, never the name, through `VariableStrategy`, what every
one of them has. `"replicated"` copies variables in TRAIN
with several towers only: evaluation and prediction read tower 0's.
"""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from replicate.gradients import aggregation
from replicate.communication import allreduce
from replicate.cluster import ps_cluster
from replicate.cluster import server
from replicate.cluster import sync_cluster
from replicate.call import devices as devices_lib
from replicate.call.strategy import GradsAndVars  # pylint: disable=unused-import
from replicate.call.strategy import VariableStrategy

PARAMETER_SERVER = "parameter_server"
ROUND_ROBIN = "round_robin"
REPLICATED = "replicated"
NAMES = (PARAMETER_SERVER, ROUND_ROBIN, REPLICATED)

class _SharedVariables:
  """Every tower trains tower 0's variables; their gradients are summed.

  Also `"replicated"` outside TRAIN or with one tower, which reads tower
  0's variables as they are.
  """

  copies_variables = False  # tower i sees tower 0's variables
  cross_task = None
  sum_device: Optional[str] = None  # where sums run (None: with the variable)

  def variable_device(self, op: tf.Operation) -> Optional[str]:
    """Where the variable `op` creates lives (None: with its tower)."""
    del op
    return None

  def combine(self, per_tower, has_rows, tower_devices) -> GradsAndVars:
    """The update's (gradient, variable) pairs from every tower's pairs."""
    del tower_devices
    return aggregation.sum_grads_and_vars(per_tower, has_rows,
                                          self.sum_device)


class ParameterServer(_SharedVariables):
  """Variables on one device: the tower's, or the CPU beside several."""

  def __init__(self, tower_devices: Sequence[str]):
    self._device = (tower_devices[0] if len(tower_devices) == 1 else
                    devices_lib.cpu_of(tower_devices[0]))

  def variable_device(self, op: tf.Operation) -> str:
    return self._device


class RoundRobin(_SharedVariables):
  """Variables on the tower devices in turn, in creation order."""

  def __init__(self, tower_devices: Sequence[str]):
    self._devices = list(tower_devices)
    self._order = {}  # variable op name -> its place in creation order

  def variable_device(self, op: tf.Operation) -> str:
    position = self._order.setdefault(op.name, len(self._order))
    return self._devices[position % len(self._devices)]


class PsCluster(_SharedVariables):
  """A ps cluster's training task: variables on the ps tasks in turn."""

  def __init__(self, num_ps: int, config):
    self._num_ps = num_ps
    self._order = {}
    # Each worker sums its towers' gradients on its own CPU, so it sends one
    # update to the ps tasks, not one per tower.
    self.sum_device = ps_cluster.gradient_sum_device(config)

  def variable_device(self, op: tf.Operation) -> str:
    position = self._order.setdefault(op.name, len(self._order))
    return "/job:ps/task:{}/device:CPU:0".format(position % self._num_ps)


class Replicated:
  """Every tower trains its own copy; gradients are all-reduced."""

  copies_variables = True
  cross_task = None

  def __init__(self, algorithm: str, compact: bool):
    self.algorithm = algorithm
    self.compact = compact

  def variable_device(self, op: tf.Operation) -> Optional[str]:
    del op
    return None  # tower 0's variables with tower 0, copies with their tower

  def combine(self, per_tower, has_rows, tower_devices) -> GradsAndVars:
    return aggregation.all_reduce_grads_and_vars(
        per_tower, has_rows, tower_devices, self.algorithm, self.compact,
        self.cross_task)


class SyncCluster(Replicated):
  """A synchronous cluster's task: `Replicated`, summed across tasks too."""

  def __init__(self, cross_task, compact: bool):
    super().__init__(allreduce.GATHER, compact)
    self.cross_task = cross_task


def for_call(variable_strategy: str, fixed_devices: Optional[List[str]],
             config, mode: str, all_reduce: str, compact: bool
            ) -> Tuple[List[str], VariableStrategy]:
  """The towers' devices and the strategy object for one model_fn call."""
  num_ps = ps_cluster.num_ps_tasks(config, mode)
  if (mode == tf.estimator.ModeKeys.TRAIN and
      sync_cluster.is_sync_cluster(config)):
    return _sync_cluster(variable_strategy, fixed_devices, config,
                         all_reduce, compact)
  if num_ps:
    if variable_strategy == REPLICATED:
      raise ValueError(
          "variable_strategy='replicated' keeps a copy of every variable on "
          "each tower, but this RunConfig's cluster has {} ps task(s), where "
          "the variables live in multi-worker training. Use "
          "variable_strategy='parameter_server' (the default) with ps "
          "tasks.".format(num_ps))
    return ps_cluster.tower_devices(fixed_devices, config), PsCluster(
        num_ps, config)
  tower_devices = devices_lib.tower_devices(fixed_devices, config)
  if variable_strategy == PARAMETER_SERVER:
    return tower_devices, ParameterServer(tower_devices)
  if variable_strategy == ROUND_ROBIN:
    return tower_devices, RoundRobin(tower_devices)
  if len(tower_devices) > 1 and mode == tf.estimator.ModeKeys.TRAIN:
    return tower_devices, Replicated(
        allreduce.resolve_algorithm(all_reduce, tower_devices), compact)
  return tower_devices, _SharedVariables()  # "replicated", read only


def _sync_cluster(variable_strategy, fixed_devices, config, all_reduce,
                  compact):
  """This task's towers and strategy in a synchronous cluster (no ps)."""
  group = sync_cluster.TaskGroup.of(config)
  if variable_strategy != REPLICATED:
    raise ValueError(
        "This RunConfig's cluster has {} training tasks ({}) and no ps "
        "tasks, which trains synchronously, every task keeping a copy of "
        "every variable: that needs variable_strategy='replicated'. "
        "Received variable_strategy={!r}. Pass "
        "variable_strategy='replicated', or add ps tasks to the cluster for "
        "variables on parameter servers.".format(
            group.size, ", ".join(group.name(r) for r in range(group.size)),
            variable_strategy))
  delay = getattr(config, "experimental_max_worker_delay_secs", None)
  if delay is None or delay > 0:
    raise ValueError(
        "In a synchronous cluster every task waits for the others at every "
        "step, so the Estimator's start delay for workers (5 s per worker "
        "index, up to 60 s, unless set) only delays the job and counts "
        "against the timeout of the first step. Pass "
        "tf.estimator.RunConfig(experimental_max_worker_delay_secs=0). "
        "Received experimental_max_worker_delay_secs={!r}.".format(delay))
  server.check_started(config)
  tower_devices = ps_cluster.tower_devices(fixed_devices, config)
  # Across tasks the ring runs over gRPC from the host, where the input,
  # the start's Python functions and the iterator are; within a task,
  # `all_reduce` is not used: the towers' sum is an add_n on tower 0.
  allreduce.resolve_algorithm(all_reduce, tower_devices)  # checks "nccl"
  cross = sync_cluster.CrossTask(group, devices_lib.cpu_of(tower_devices[0]))
  return tower_devices, SyncCluster(cross, compact)
