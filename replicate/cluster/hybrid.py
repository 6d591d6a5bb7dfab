"""Embeddings on ps tasks, everything else replicated: one synchronous step.

On the cluster: a `TF_CONFIG` cluster with `ps` tasks, trained with
`variable_strategy="replicated"` after `replicate.start_server`, trains in
lockstep as a cluster without ps does (`replicate.cluster.sync_cluster`),
except for the variables the `model_fn` partitions
(`get_variable(..., partitioner=...)`, or a `variable_scope`'s
partitioner, as the canned estimators' `input_layer_partitioner`): those
live once, sharded over the ps tasks (the parts in turn, in creation order,
as `replica_device_setter` places them). No task holds a copy of them: a
tower's lookups read only its rows from the ps tasks.

On the step: every task sums the gradients of a ps-held variable over its
towers and across tasks as it sums any other (a sparse one as slices), so
every task has the whole step's; only the chief applies them, with the
optimizer's update on the ps tasks (slots live beside their variable).
Then every task meets at a barrier (a 1-float sum across tasks) that waits
for its whole step, the chief's ps update included: no task's next step,
its lookups, can start before that update is done. The barrier also keeps
every ps op of a step upstream of the task's last collective: the tasks'
runs of a step share one step id on a ps task, and a run that ends first
would clean up (abort) the other's ps transfers of that step.

On state that is not partitioned: the global step, which the Estimator
made on a ps task, moves to this task (each task counts its own, equal
ones, as in a cluster without ps); optimizer variables that are not slots
(Adam's beta powers), which TensorFlow colocates with the first variable
by name, are made on tower 0 when that variable is on a ps task: every
task updates its own, once a step.
"""

import contextlib
from typing import Iterable, List

import tensorflow as tf

from replicate import _tf

PS_JOB = "ps"

# Ops that read a ps-held variable for a tower, a summary or a metric.
_READ_TYPES = frozenset(["ReadVariableOp", "ResourceGather",
                         "ResourceGatherNd", "Identity", "Gather",
                         "GatherV2"])


def on_ps(variable_or_op) -> bool:
  """Whether a variable (or its op) lives on a ps task, read from its
  device."""
  op = getattr(variable_or_op, "op", variable_or_op)
  return tf.DeviceSpec.from_string(op.device or "").job == PS_JOB


class PsPlacement:
  """Places the parts of the variables tower 0 partitions on the ps tasks.

  `getter` is a `variable_scope` custom getter that marks a partitioned
  variable's creation; `device(op)` gives its parts' ops the ps tasks in
  turn, and every other variable None (the tower's device).
  """

  def __init__(self, num_ps: int):
    self._num_ps = num_ps
    self._parts = 0  # parts placed so far, in creation order
    self._partitioning = 0  # depth of partitioned creations under way

  def device(self, op: tf.Operation):
    if not self._partitioning:
      return None
    del op
    task = self._parts % self._num_ps
    self._parts += 1
    return "/job:{}/task:{}/device:CPU:0".format(PS_JOB, task)

  def getter(self, getter, name, *args, **kwargs):
    if kwargs.get("partitioner") is None:
      return getter(name, *args, **kwargs)
    self._partitioning += 1
    try:
      return getter(name, *args, **kwargs)
    finally:
      self._partitioning -= 1

  @contextlib.contextmanager
  def in_scope(self):
    """While tower 0 is built: the getter on the current variable scope
    (inherited by the scopes the model_fn opens)."""
    scope = tf.compat.v1.get_variable_scope()
    outer = scope.custom_getter
    if outer is None:
      getter = self.getter
    else:
      def getter(getter, name, *args, **kwargs):  # TF passes by keyword
        return self.getter(lambda *a, **k: outer(getter, *a, **k),
                           name, *args, **kwargs)
    scope.set_custom_getter(getter)
    try:
      yield
    finally:
      scope.set_custom_getter(outer)


def move_global_step(graph: tf.Graph, device: str) -> None:
  """The Estimator's global step, made on a ps task, to `device`: each task
  counts its own (the ops made with it are colocated with it and follow)."""
  step = tf.compat.v1.train.get_global_step(graph)
  if step is not None and on_ps(step):
    _tf.set_device(step.op, device)


def ps_neighbour(colocated: Iterable, name: str):
  """The ps-held variable's op among `colocated` (what a variable named
  `name` is made colocated with), and whether `name` is a slot of it
  (`<its name>/...`); (None, False) when there is none."""
  for op in colocated:  # ops, or a variable's device-only stand-in
    if on_ps(op):
      return op, name.startswith(op.name.split(":")[0] + "/")
  return None, False


def ps_reads(graph: tf.Graph, variables) -> List[tf.Operation]:
  """The ops of `graph` (outside control flow) reading `variables`."""
  outputs = {v.op.outputs[0].ref() for v in variables}
  reads = []
  for op in graph.get_operations():
    if (op.type in _READ_TYPES and op.inputs and
        op.inputs[0].ref() in outputs and
        not _tf.built_in_control_flow(op)):
      reads.append(op)
  return reads


def ps_held(variables) -> List[tf.Variable]:
  """The ones of `variables` that live on a ps task."""
  return [v for v in variables if on_ps(v)]
