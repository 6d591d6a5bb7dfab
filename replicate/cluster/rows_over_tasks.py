"""`replicate.all_rows` across the tasks of a synchronous cluster.

On the forward pass: a task concatenates its towers' real rows of an
`all_rows` call, in tower order, and all-gathers them across tasks in rank
order (`replicate.cluster.ragged.gather_ragged`: the lengths first, since
every task has its own rows, an empty task none; then the rows, padded to
a power of two). So every tower of every task sees the rows of the
concatenated batch one device is given: the chief's, then worker 0's, ...

On the backward pass: a task sums its towers' gradients with respect to
the whole batch's rows, then sums that over tasks
(`replicate.cluster.ragged.sum_ragged`: the batch's length is the same on
every task, but changes between steps), so each tower takes the rows that
are its own from the gradient of every tower's loss.

On where a task's rows start: after the rows of the tasks before it, which
the step's first all-gather counted (`replicate.cluster.sync_input`).

Only TRAIN crosses tasks: EVAL and PREDICT in a cluster run on one task's
own towers (`replicate.variables.strategies.for_call`), and `all_rows` is
then that machine's batch.
"""

import tensorflow as tf

from replicate.cluster import ragged

# What CollectiveGatherV2 carries (bool travels as int32).
_CARRIED = frozenset([tf.float16, tf.float32, tf.float64, tf.int32,
                      tf.int64, tf.bool])


def check_dtype(tensor: tf.Tensor) -> None:
  """Refuses rows of a dtype the collectives cannot carry, with the fix."""
  if tensor.dtype.base_dtype not in _CARRIED:
    raise ValueError(
        "replicate.all_rows({!r}) in a synchronous cluster: its rows are {}, "
        "which TensorFlow's collectives cannot carry across tasks (float16, "
        "float32, float64, int32, int64 and bool can). Fix: cast the tensor "
        "to one of those before all_rows, and back after.".format(
            tensor.name, tensor.dtype.base_dtype.name))


def task_start(layout) -> tf.Tensor:
  """The index in the whole batch of this task's first row (int32)."""
  cross = layout.cross_task
  with tf.device(cross.device), tf.name_scope("task_start"):
    return tf.cast(tf.reduce_sum(layout.task_rows[:cross.group.rank]),
                   tf.int32)


def gather_rows(cross, rows: tf.Tensor) -> tf.Tensor:
  """Every task's `rows` (this task's towers' rows), in rank order."""
  with tf.device(cross.device), tf.name_scope("rows_over_tasks"):
    carried = tf.cast(rows, tf.int32) if rows.dtype == tf.bool else rows
    whole = ragged.gather_ragged(cross, [carried])[0]
    return tf.cast(whole, tf.bool) if rows.dtype == tf.bool else whole


def sum_gradient(cross, gradient: tf.Tensor) -> tf.Tensor:
  """A task's gradient w.r.t. the whole batch's rows, summed over tasks."""
  with tf.device(cross.device), tf.name_scope("all_rows_gradient_over_tasks"):
    return ragged.sum_ragged(cross, gradient)
