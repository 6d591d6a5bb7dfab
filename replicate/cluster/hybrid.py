"""Embeddings on ps tasks, everything else replicated: one synchronous step.

On the cluster: a `TF_CONFIG` cluster with `ps` tasks, trained with
`variable_strategy="replicated"` after `replicate.start_server`, trains in
lockstep as a cluster without ps does (`replicate.cluster.sync_cluster`),
except for the variables the `model_fn` partitions
(`get_variable(..., partitioner=...)`, or a `variable_scope`'s
partitioner, as the canned estimators' `input_layer_partitioner`) and
looks up by rows (`replicate.cluster.ps_placement`): those live once,
sharded over the ps tasks (the parts in turn, in creation order, as
`replica_device_setter` places them). No task holds a copy of them: a
tower's lookups read only its rows from the ps tasks.

On the step: every task sends its slices of a ps-held variable's gradient
to the ps task that holds it, where the chief takes their sum and applies
it with the optimizer's update (slots live beside their variable); where
the `model_fn` reads those gradients, every task all-gathers every task's
slices instead and the chief applies them
(`replicate.variables.ps_slices`). Then every task meets at a barrier (a 1-float sum across tasks) that waits
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


def move_global_step(graph: tf.Graph, device: str) -> None:
  """The Estimator's global step, made on a ps task, to `device`: each task
  counts its own (the ops made with it are colocated with it and follow)."""
  step = tf.compat.v1.train.get_global_step(graph)
  if step is not None and on_ps(step):
    _tf.set_device(step.op, device)


def ps_neighbour(colocated: Iterable, name: str):
  """The ps-held variable's op among `colocated` (what a variable named
  `name` is made colocated with), and whether `name` is a slot of it
  (`<its name>/...`, under the variable scope the update is built in: a
  canned DNN's `dnn/` makes `dnn/<its name>/Adagrad`); (None, False) when
  there is none."""
  for op in colocated:  # ops, or a variable's device-only stand-in
    if on_ps(op):
      return op, "/{}/".format(op.name.split(":")[0]) in "/" + name
  return None, False


@contextlib.contextmanager
def made_by_update(graph: tf.Graph, name: str, tower0_device: str):
  """Where an optimizer's update makes a variable named `name`, beside a
  ps-held variable: a slot of it stays with it, on the ps task; an
  optimizer's own variable (Adam's beta powers), which TensorFlow puts
  beside the first variable by name, goes to `tower0_device`, so that each
  task keeps and updates its own. Yields a list that gets the variable
  made."""
  ps_op, is_slot = ps_neighbour(_tf.colocation_ops(graph), name)
  made = []
  if ps_op is None or is_slot:
    yield made
  else:
    with graph.colocate_with(None, ignore_existing=True), graph.device(
        tower0_device):
      yield made
  if ps_op is not None and is_slot and made:
    # Its handle follows the device functions around the colocation.
    _tf.set_device(made[0].op, ps_op.device)


def check_updated_once(variable, trainable: bool) -> None:
  """Refuses a ps-held variable that is not trainable: every task would
  write it (a statistic's update), once each."""
  if not trainable:
    raise ValueError(
        "The variable {!r} is partitioned and not trainable. With ps "
        "tasks and variable_strategy='replicated', what the model_fn "
        "partitions lives once on the ps tasks, and only the optimizer's "
        "update is applied once a step; every task would change this "
        "variable itself. Create it without a partitioner (each task "
        "keeps its own copy, combined as on one machine).".format(
            variable.op.name.rpartition("/part_")[0] or variable.op.name))


def duplicates_summed(grad):
  """`grad` with one slice per row (`IndexedSlices`; else as it is): what
  a sparse apply computes first (unique rows, their slices summed in
  order), made here so that only the distinct rows travel to the ps."""
  if not isinstance(grad, tf.IndexedSlices):
    return grad
  rows, positions = tf.unique(grad.indices)
  values = tf.math.unsorted_segment_sum(grad.values, positions,
                                        tf.shape(rows)[0])
  return tf.IndexedSlices(values, rows, grad.dense_shape)


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


def after_the_ps_update(cross, train_op, shared) -> tf.Operation:
  """The step's barrier, with variables on ps tasks: a 1-float sum across
  tasks after this task's whole step (the chief's: its update of the ps
  tasks' variables too) and every read of them made so far (a summary's),
  so that no task starts the next step's lookups before the update is
  done, and no ps op of the step runs after a task's last collective
  (`replicate.cluster.hybrid`)."""
  reads = ps_reads(train_op.graph, shared)
  with tf.control_dependencies([train_op] + list(cross.step_ops) + reads):
    barrier = cross.sum(tf.ones([1], tf.float32), name="after_ps_update")
  return barrier.op
