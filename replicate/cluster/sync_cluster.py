"""Synchronous training across the tasks of a cluster without ps tasks.

On the cluster: a `TF_CONFIG` cluster of `chief` and `worker` tasks (no
`ps`), with `variable_strategy="replicated"`, trains in lockstep. Each
training task builds one tower per local device with a copy of every
variable on each; what one machine combines over its towers (gradients,
the loss, row counts, loss denominators, statistics, tower-local
variables, synchronized batch norm's moments), each task sums over its own
towers first, then across tasks with a `CollectiveReduceV2` (or
`CollectiveGatherV2`) on its first CPU, a ring over gRPC. So a step is one
device's on the concatenation of every task's batch, in rank order: the
chief, then worker 0, 1, ....

On keys: every cross-task collective uses one group (the first CPU of
every task, `GROUP_KEY`) and an instance key given out in building order,
per graph, from `FIRST_INSTANCE_KEY`. Every task builds the same graph, so
the keys agree; the start's check of the model
(`replicate.cluster.sync_session`) uses a fixed key below that, so that
tasks built differently meet there and say so, instead of waiting on
different keys.

On the step: its collectives run after the check that every task's input
goes on (`after_check`, `replicate.cluster.sync_input`), and the step's
`train_op` waits for every one of them (`step_ops`), so that every task
runs each exactly once a step, whatever else a task fetches (the chief's
summaries).

On time: `timeout_seconds()` (`REPLICATE_SYNC_TIMEOUT_SECS`, default 120)
bounds how long a task waits for the others: the bound on noticing a dead
or frozen task, and also the longest any task may lag the others (a slow
`input_fn`, the chief saving a checkpoint, a late start). The collectives
of the start (run once) carry it as their own timeout. The step's do not:
TensorFlow starts a thread per collective run that sleeps out the timeout,
thousands a minute at a few hundred steps a second, until the process
cannot start another. A step is bounded by
`replicate.cluster.sync_session.WatchdogHook` instead.
"""

import contextlib
import os
import weakref
from typing import List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from replicate.cluster import ragged

TIMEOUT_ENV = "REPLICATE_SYNC_TIMEOUT_SECS"
DEFAULT_TIMEOUT_SECONDS = 120.0

GROUP_KEY = 7001  # the first CPU of every task
FINGERPRINT_INSTANCE_KEY = 1
FIRST_INSTANCE_KEY = 100

_TRAINING_JOBS = ("chief", "worker", "master")
_HINT = "ring"  # over gRPC, from each task's CPU

# Per graph, the next free instance key of the cross-task group.
_next_instance_key = weakref.WeakKeyDictionary()


def timeout_seconds() -> float:
  """How long a task waits for the others at a collective, in seconds."""
  text = os.environ.get(TIMEOUT_ENV)
  if text is None:
    return DEFAULT_TIMEOUT_SECONDS
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise ValueError(
        "{} must be a number of seconds greater than 0. Received: {!r}. "
        "Unset it for the default, {:g} s.".format(
            TIMEOUT_ENV, text, DEFAULT_TIMEOUT_SECONDS))
  return value


def training_tasks(cluster_spec) -> List[Tuple[str, int]]:
  """The cluster's training tasks in rank order: chief (or master), workers."""
  tasks = []
  for job in _TRAINING_JOBS:
    if cluster_spec and job in cluster_spec.jobs:
      tasks.extend((job, index) for index in cluster_spec.task_indices(job))
  return tasks


def is_sync_cluster(config) -> bool:
  """Whether `config`'s cluster trains synchronously: tasks, no ps."""
  spec = getattr(config, "cluster_spec", None)
  if not spec or not spec.jobs or "ps" in spec.jobs:
    return False
  return (len(training_tasks(spec)) > 1 and
          getattr(config, "task_type", None) in _TRAINING_JOBS)


class TaskGroup(NamedTuple):
  """This task among the cluster's training tasks."""
  tasks: List[Tuple[str, int]]  # every training task, in rank order
  rank: int  # this task's place in `tasks`

  @classmethod
  def of(cls, config) -> "TaskGroup":
    tasks = training_tasks(config.cluster_spec)
    return cls(tasks, tasks.index((config.task_type, config.task_id)))

  @property
  def size(self) -> int:
    return len(self.tasks)

  @property
  def is_chief(self) -> bool:
    return self.rank == 0

  def name(self, rank: Optional[int] = None) -> str:
    job, index = self.tasks[self.rank if rank is None else rank]
    return "{}:{}".format(job, index)


class CrossTask:
  """Collectives across tasks, from `device`: this task's first CPU."""

  def __init__(self, group: TaskGroup, device: str):
    self.group = group
    self.device = device
    self.timeout = timeout_seconds()
    # The step's collectives, in key order, and what they wait for: the
    # check that every task's input goes on (`replicate.cluster.sync_input`).
    self.step_ops: List[tf.Operation] = []
    self.after_check: Optional[tf.Operation] = None
    # Called, in this process, when the step stops every task at the end
    # of an input (the watchdog's disarming).
    self.on_stop: List = []

  def sum(self, tensor: tf.Tensor, name: str = "sum_over_tasks",
          timeout: float = 0) -> tf.Tensor:
    """The sum of `tensor` over every task, on this task's device.

    `timeout`: seconds the collective waits for the others (0: no limit).
    """
    with tf.device(self.device), tf.name_scope(name), self.in_step():
      summed = tf.raw_ops.CollectiveReduceV2(
          input=tensor, merge_op="Add", final_op="Id", ordering_token=[],
          communication_hint=_HINT, timeout_seconds=timeout,
          **self._keys(next_instance_key(tensor.graph)))
    self.step_ops.append(summed.op)
    return summed

  def sum_all(self, tensors: Sequence[tf.Tensor], name: str = "sum_over_tasks"
             ) -> List[tf.Tensor]:
    """`sum` of several tensors, one collective per dtype.

    Tensors of a shape not fully known get a collective each.
    """
    by_dtype = {}
    results = [None] * len(tensors)
    with tf.device(self.device), tf.name_scope(name):
      for position, tensor in enumerate(tensors):
        if tensor.shape.is_fully_defined():
          by_dtype.setdefault(tensor.dtype.base_dtype, []).append(position)
        else:
          results[position] = self.sum(tensor)
      for positions in by_dtype.values():
        parts = [tensors[p] for p in positions]
        packed = tf.concat([tf.reshape(t, [-1]) for t in parts], axis=0)
        pieces = tf.split(self.sum(packed),
                          [t.shape.num_elements() for t in parts])
        for position, piece, part in zip(positions, pieces, parts):
          results[position] = tf.reshape(piece, part.shape)
    return results

  def gather(self, tensor: tf.Tensor, instance_key: Optional[int] = None,
             timeout: float = 0) -> tf.Tensor:
    """Every task's `tensor`, concatenated along dimension 0 in rank order.

    With an `instance_key` of its own it is the start's, not the step's.
    """
    in_step = instance_key is None
    with tf.device(self.device), (
        self.in_step() if in_step else contextlib.nullcontext()):
      gathered = tf.raw_ops.CollectiveGatherV2(
          input=tensor, ordering_token=[], communication_hint=_HINT,
          timeout_seconds=timeout,
          **self._keys(instance_key or next_instance_key(tensor.graph)))
    if in_step:
      self.step_ops.append(gathered.op)
    return gathered

  def broadcast(self, tensor: tf.Tensor, timeout: float = 0) -> tf.Tensor:
    """The chief's `tensor` on every task (`tensor` must be alike on all)."""
    keys = self._keys(next_instance_key(tensor.graph))
    with tf.device(self.device):
      if self.group.is_chief:
        return tf.raw_ops.CollectiveBcastSendV2(
            input=tensor, communication_hint=_HINT,
            timeout_seconds=timeout, **keys)
      return tf.raw_ops.CollectiveBcastRecvV2(
          shape=tf.shape(tensor), T=tensor.dtype,
          communication_hint=_HINT, timeout_seconds=timeout, **keys)

  def gather_slices(self, pairs: Sequence[Tuple[tf.Tensor, tf.Tensor]],
                    name: str = "slices_over_tasks"
                   ) -> List[Tuple[tf.Tensor, tf.Tensor]]:
    """Every task's slices, concatenated, for each (`values` [k, ...],
    `indices` [k]) pair of `pairs` (a step's sparse gradients).

    In rank order, so each result is what one device's sum over the
    concatenated batches holds, duplicates included. `k` differs between
    tasks and steps; the pairs share their collectives
    (`ragged.gather_ragged_groups`).
    """
    for values, _ in pairs:
      if values.dtype.base_dtype not in _GATHERED_DTYPES:
        raise ValueError(
            "A sparse gradient (tf.IndexedSlices) of {} cannot cross the "
            "tasks of a synchronous cluster: TensorFlow's collectives carry "
            "float16, float32 and float64 gradients only. Fix: compute the "
            "embedding's gradient in one of those (e.g. keep the variable "
            "float32 and cast after the lookup), or train with ps "
            "tasks.".format(values.dtype.base_dtype.name))
    with tf.device(self.device), tf.name_scope(name):
      return ragged.gather_ragged_groups(
          self, [(values, tf.cast(indices, tf.int64))
                 for values, indices in pairs])

  def step_collective(self, op_type: str, tensor: tf.Tensor, instance_key,
                      **attributes) -> tf.Tensor:
    """A V2 collective `op_type` of `tensor` in the step (no timeout: the
    watchdog bounds it), on `instance_key` (an int or an int32 tensor)."""
    with tf.device(self.device), self.in_step():
      result = getattr(tf.raw_ops, op_type)(
          input=tensor, ordering_token=[], communication_hint=_HINT,
          timeout_seconds=0, **self._keys(instance_key), **attributes)
    self.step_ops.append(result.op)
    return result

  def reserve_keys(self, graph: tf.Graph, count: int) -> int:
    """The first of `count` consecutive fresh instance keys in `graph`."""
    return reserve_instance_keys(graph, count)

  def in_step(self):
    """After the check that every input goes on, once there is one."""
    if self.after_check is None:
      return contextlib.nullcontext()
    return tf.control_dependencies([self.after_check])

  def _keys(self, instance_key):
    return dict(group_size=tf.constant(self.group.size),
                group_key=tf.constant(GROUP_KEY),
                instance_key=tf.convert_to_tensor(instance_key, tf.int32))


def next_instance_key(graph: tf.Graph) -> int:
  """A fresh instance key of the cross-task group in `graph`."""
  key = _next_instance_key.get(graph, FIRST_INSTANCE_KEY)
  _next_instance_key[graph] = key + 1
  return key


# The dtypes of sparse gradients' values CollectiveGatherV2 carries.
_GATHERED_DTYPES = frozenset([tf.float16, tf.float32, tf.float64])


def reserve_instance_keys(graph: tf.Graph, count: int) -> int:
  """The first of `count` consecutive fresh instance keys in `graph`."""
  first = next_instance_key(graph)
  _next_instance_key[graph] = first + count
  return first
