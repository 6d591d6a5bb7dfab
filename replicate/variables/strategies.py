"""One small object per `variable_strategy`: where variables live, what a
tower sees of them, and how the towers' gradients become the update.

| strategy | a variable goes | tower i sees | the towers' gradients |
| --- | --- | --- | --- |
| `ParameterServer` | on the one device, or `/device:CPU:0` with several | tower 0's variable | summed with the variable |
| `RoundRobin` | on the tower devices in turn, in creation order | tower 0's variable | summed with the variable |
| `Replicated` | with tower 0; tower i's copy on tower i | its own copy of each trainable variable | all-reduced: every copy gets the sum |
| `PsCluster` | on the ps tasks in turn | tower 0's variable | summed on this worker's CPU, one update sent |
| `SyncCluster` | as `Replicated`, on this task | as `Replicated` | summed on this task, then across tasks (`replicate.cluster.sync_cluster`) |
| `HybridCluster` | partitioned: on the ps tasks in turn; else as `SyncCluster` | partitioned: the ps tasks' parts; else as `SyncCluster` | as `SyncCluster`; the chief alone applies the ps tasks' (`replicate.cluster.hybrid`) |

For one call of the wrapped `model_fn`: `check_cluster` refuses a
`variable_strategy` the cluster cannot train with, `tower_devices` finds
the towers' devices, and `for_call` picks the object from the
`variable_strategy` name, those devices, the mode and the `RunConfig`;
everything else asks the object, never the name, through
`VariableStrategy`, what every one of them has, and what its mode means
through its methods (`replicate.variables.tasks`: `OneTask` or
`AcrossTasks`). `"replicated"` copies variables in TRAIN with several
towers only: evaluation and prediction read tower 0's.
"""

import contextlib
from typing import List, Optional, Sequence

import tensorflow as tf

from replicate.gradients import aggregation
from replicate.communication import allreduce
from replicate.variables import ps_slices
from replicate.cluster import empty_batch
from replicate.cluster import hybrid
from replicate.cluster import ps_cluster
from replicate.cluster import ps_placement
from replicate.cluster import ps_watch
from replicate.cluster import server
from replicate.cluster import sync_cluster
from replicate.call import devices as devices_lib
from replicate.call.strategy import GradsAndVars
from replicate.call.strategy import VariableStrategy
from replicate.variables import tasks

PARAMETER_SERVER = "parameter_server"
ROUND_ROBIN = "round_robin"
REPLICATED = "replicated"
NAMES = (PARAMETER_SERVER, ROUND_ROBIN, REPLICATED)

class _SharedVariables(tasks.OneTask):
  """Every tower trains tower 0's variables; their gradients are summed.

  Also `"replicated"` outside TRAIN or with one tower, which reads tower
  0's variables as they are.
  """

  copies_variables = False  # tower i sees tower 0's variables
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

  def sum_gradients(self, per_tower: Sequence[list],
                    tower_devices: Sequence[str]) -> List[list]:
    """Per tower, the sums of the towers' gradients, place by place (None:
    a tower without rows): one sum, with tower 0 or on `sum_device`."""
    del tower_devices
    with (tf.device(self.sum_device) if self.sum_device else
          contextlib.nullcontext()):
      totals = [aggregation.add_gradients(
          [tower[p] for tower in per_tower if tower[p] is not None])
                for p in range(len(per_tower[0]))]
    return [totals] * len(per_tower)


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


class Replicated(tasks.OneTask):
  """Every tower trains its own copy; gradients are all-reduced."""

  copies_variables = True

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

  def sum_gradients(self, per_tower: Sequence[list],
                    tower_devices: Sequence[str]) -> List[list]:
    """Per tower, the all-reduced sums of the towers' gradients, place by
    place (None: a tower without rows)."""
    return allreduce.all_reduce_grads(per_tower, tower_devices,
                                      self.algorithm, self.compact,
                                      self.cross_task)


class SyncCluster(tasks.AcrossTasks, Replicated):
  """A synchronous cluster's task: `Replicated`, summed across tasks too."""

  def __init__(self, cross_task, compact: bool):
    super().__init__(allreduce.GATHER, compact)
    self.cross_task = cross_task


class HybridCluster(SyncCluster):
  """A task of a cluster with ps tasks, trained `"replicated"`: what the
  `model_fn` partitions lives on the ps tasks, the rest as `SyncCluster`
  (`replicate.cluster.hybrid`)."""

  def __init__(self, cross_task, compact: bool, num_ps: int):
    super().__init__(cross_task, compact)
    self._placement = ps_placement.PsPlacement(num_ps)
    # The ps-held variables' summed slices `for_session` settles.
    self._pending: List[ps_slices.Pending] = []

  def variable_device(self, op: tf.Operation) -> Optional[str]:
    return self._placement.device(op)

  def combine(self, per_tower, has_rows, tower_devices) -> GradsAndVars:
    """As `SyncCluster`'s, but a ps-held variable's slices: this task's
    own, summed over its towers, behind a stand-in that `for_session`
    settles, straight to the ps or gathered to every task
    (`replicate.variables.ps_slices`)."""
    summed, records = ps_slices.held_apart(
        per_tower, has_rows, tower_devices,
        lambda others: super(HybridCluster, self).combine(
            others, has_rows, tower_devices))
    self._pending.extend(records)
    return summed

  def for_session(self, spec: tf.estimator.EstimatorSpec, config,
                  mode: str) -> tf.estimator.EstimatorSpec:
    """As `SyncCluster`'s, and in TRAIN with variables on the ps tasks, a
    hook that ends this task in seconds when one of them dies
    (`replicate.cluster.ps_watch`)."""
    if mode == tf.estimator.ModeKeys.TRAIN:
      records, self._pending = self._pending, []
      spec = ps_slices.settled(spec, self.cross_task, records)
    spec = super().for_session(spec, config, mode)
    if (mode != tf.estimator.ModeKeys.TRAIN or
        not hybrid.ps_held(tf.compat.v1.global_variables())):
      return spec
    watch = ps_watch.PsWatchHook(self.cross_task.group.name(), {
        "ps:{}".format(index): config.cluster_spec.task_address("ps", index)
        for index in config.cluster_spec.task_indices("ps")})
    self.cross_task.on_stop.append(watch.disarm)  # an input's end
    return spec._replace(training_hooks=list(spec.training_hooks) + [watch])

  @contextlib.contextmanager
  def tower_scope(self, index: int):
    """Where tower `index` is built: tower 0 places what it partitions;
    every tower may be built from an empty batch
    (`replicate.cluster.empty_batch`)."""
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    with (self._placement.in_scope() if index == 0 else
          contextlib.nullcontext()):
      yield
    empty_batch.guard_sparse_reshapes(graph.get_operations()[before:])


def _is_sync_training(config, mode: str) -> bool:
  return (mode == tf.estimator.ModeKeys.TRAIN and
          sync_cluster.is_sync_cluster(config))


def _is_hybrid_training(variable_strategy: str, config, mode: str) -> bool:
  """A cluster with ps tasks trained "replicated": `HybridCluster`."""
  return (variable_strategy == REPLICATED and
          ps_cluster.num_ps_tasks(config, mode) > 0)


def check_cluster(variable_strategy: str, config, mode: str) -> None:
  """Refuses a `variable_strategy` (or a `RunConfig`) this call's cluster
  cannot train with, with the fix; checks a synchronous cluster's server."""
  if _is_sync_training(config, mode):
    _check_sync_cluster(variable_strategy, config)
    return
  if _is_hybrid_training(variable_strategy, config, mode):
    _check_lockstep(config)


def tower_devices(fixed_devices: Optional[List[str]], config,
                  mode: str) -> List[str]:
  """The towers' devices for one call: this task's server's in a cluster
  (`fixed_devices`, or all its GPUs or CPUs), else the local ones."""
  if _is_sync_training(config, mode) or ps_cluster.num_ps_tasks(config, mode):
    return ps_cluster.tower_devices(fixed_devices, config)
  return devices_lib.tower_devices(fixed_devices, config)


def for_call(variable_strategy: str, devices: List[str], config, mode: str,
             all_reduce: str, compact: bool) -> VariableStrategy:
  """The strategy object for one model_fn call on the towers' `devices`
  (`tower_devices`), after `check_cluster`."""
  num_ps = ps_cluster.num_ps_tasks(config, mode)
  hybrid_training = _is_hybrid_training(variable_strategy, config, mode)
  if _is_sync_training(config, mode) or hybrid_training:
    # Across tasks the ring runs over gRPC from the host, where the input,
    # the start's Python functions and the iterator are; within a task,
    # `all_reduce` is not used: the towers' sum is an add_n on tower 0.
    allreduce.resolve_algorithm(all_reduce, devices)  # checks "nccl"
    cross = sync_cluster.CrossTask(sync_cluster.TaskGroup.of(config),
                                   devices_lib.cpu_of(devices[0]))
    if not hybrid_training:
      return SyncCluster(cross, compact)
    hybrid.move_global_step(tf.compat.v1.get_default_graph(), cross.device)
    return HybridCluster(cross, compact, num_ps)
  if num_ps:
    return PsCluster(num_ps, config)
  if variable_strategy == PARAMETER_SERVER:
    return ParameterServer(devices)
  if variable_strategy == ROUND_ROBIN:
    return RoundRobin(devices)
  if len(devices) > 1 and mode == tf.estimator.ModeKeys.TRAIN:
    return Replicated(allreduce.resolve_algorithm(all_reduce, devices),
                      compact)
  return _SharedVariables()  # "replicated", read only


def _check_sync_cluster(variable_strategy, config):
  """A synchronous cluster trains with "replicated", no start delay, and
  the server started."""
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
  _check_lockstep(config)


def _check_lockstep(config):
  """Tasks that step together: no start delay, and the server started."""
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
