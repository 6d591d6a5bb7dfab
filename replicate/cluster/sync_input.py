"""A synchronous cluster's batch: every task takes its own, or all stop.

On the end of input: one device stops when its `input_fn`'s dataset ends
(the Estimator ends training on `OutOfRangeError`). In a synchronous
cluster a task whose input ended cannot just stop: the others would wait
for it at the step's first collective until it timed out. So each task
takes its batch as an optional (`IteratorGetNextAsOptional` on the
Estimator's iterator, in place of its `IteratorGetNext`), and the step
starts with one all-gather of (whether this task's input ended, its rows).
If any task's ended, every task raises `OutOfRangeError` at that point,
before any variable changes (the towers' forward pass does not wait for
the all-gather when the task's own batch is there; what changes state
waits for a collective, and every collective for the check): the
Estimator ends training cleanly on every task at the same step, and the
chief writes its last checkpoint. The same
all-gather gives every task's rows this step: their sum `n`, by which each
tower's share `n_i / n` is counted, and the rows of the tasks before this
one (where its rows start in the batch: `replicate.row_offset`).

Input that does not come from a `tf.data.Dataset` (a queue, as
`numpy_input_fn` makes) cannot be taken so and is refused with the fix;
input that never ends (constant tensors) only has its rows counted.
"""

from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from replicate import _tf
from replicate import graph_walk

_ITERATOR_OP_TYPES = frozenset(["IteratorGetNext", "IteratorGetNextSync"])
_QUEUE_OP_TYPES = frozenset([
    "IteratorGetNextAsOptional", "QueueDequeue", "QueueDequeueV2",
    "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo",
    "QueueDequeueUpToV2"])


def take_batch(features, labels, cross) -> Tuple[Any, Any, Optional[tf.Tensor]]:
  """(features, labels, every task's rows this step in rank order, or None).

  None when the batch does not come from a dataset: the caller counts the
  rows itself (`count_rows`).
  """
  leaves = [t for t in tf.nest.flatten((features, labels),
                                       expand_composites=True)
            if isinstance(t, tf.Tensor)]
  sources = [op for op in graph_walk.ops_behind(
      leaves, stop_at_types=_ITERATOR_OP_TYPES | _QUEUE_OP_TYPES)
             if op.type in _ITERATOR_OP_TYPES | _QUEUE_OP_TYPES]
  queues = [op for op in sources if op.type in _QUEUE_OP_TYPES]
  if queues or len(sources) > 1:
    raise ValueError(
        "In a synchronous cluster every task's input_fn must return a "
        "tf.data.Dataset (or its features and labels straight from one "
        "iterator), so that a task whose input ends stops every task at "
        "the same step. This input comes from {}. Fix: return a dataset, "
        "e.g. tf.data.Dataset.from_tensor_slices((features, labels))."
        "batch(batch_size) in place of numpy_input_fn or a queue.".format(
            ", ".join("{!r} ({})".format(op.name, op.type)
                      for op in queues or sources)))
  if not sources:
    return features, labels, None
  get_next = sources[0]
  waiting = [op for op in get_next.graph.get_operations()
             if get_next in op.control_inputs]
  if waiting:
    raise ValueError(
        "In a synchronous cluster the batch is taken in place of the "
        "input_fn's iterator's get_next, but {} wait for that op itself "
        "(a control dependency), so it would still run and take a batch of "
        "its own. Fix: make them depend on the features' values, not on "
        "the op.".format(", ".join(repr(op.name) for op in waiting)))
  types = get_next.get_attr("output_types")
  shapes = [tf.TensorShape(s) for s in get_next.get_attr("output_shapes")]
  with tf.device(cross.device), tf.name_scope("take_batch"):
    optional = tf.raw_ops.IteratorGetNextAsOptional(
        iterator=get_next.inputs[0], output_types=types,
        output_shapes=shapes)
    has_value = tf.raw_ops.OptionalHasValue(optional=optional)
    rows = _rows_if_any(optional, has_value, types, shapes)
    mine = tf.stack([1 - tf.cast(has_value, tf.int64), rows])[tf.newaxis]
    every_task = cross.gather(mine)  # [tasks, 2]: (ended, rows)
    check = tf.numpy_function(  # on the task's CPU, as Python functions are
        _StopIfAnyEnded(cross.group.tasks, cross.on_stop),
        [every_task[:, 0]], tf.int64, stateful=True,
        name="stop_if_any_input_ended")
    cross.after_check = check.op  # every later collective of the step
    with tf.control_dependencies([_own_batch_or_check(has_value, check)]):
      values = tf.raw_ops.OptionalGetValue(
          optional=optional, output_types=types, output_shapes=shapes)
  replaced = dict(zip(get_next.outputs, values))
  for old, new in replaced.items():
    new.set_shape(old.shape)
    for consumer in old.consumers():
      for index, tensor in enumerate(consumer.inputs):
        if tensor is old:
          _tf.update_input(consumer, index, new)
  features, labels = tf.nest.map_structure(
      lambda leaf: replaced.get(leaf, leaf) if isinstance(leaf, tf.Tensor)
      else leaf, (features, labels), expand_composites=True)
  return features, labels, every_task[:, 1]


def _own_batch_or_check(has_value, check) -> tf.Tensor:
  """Ready at once when this task has a batch; else after the check.

  So the towers' forward pass starts while the all-gather of every task's
  (ended, rows) and the check run, instead of a round trip over every task
  later: what the step changes waits for the check all the same (every
  collective of the step does, and every update waits for a collective).
  When this task's own input ended, its batch is taken only after the
  check, which then raises the clean end of training (taking a value of
  the empty optional would fail first, with another error).

  `Switch` and `Merge`, as a TF 1 `cond`: `Merge` fires on its first live
  input, so with a batch it does not wait for the check's (dead) side.
  """
  without_batch, with_batch = tf.raw_ops.Switch(data=has_value,
                                                pred=has_value)
  with tf.control_dependencies([check]):
    checked = tf.identity(without_batch)
  ready, _ = tf.raw_ops.Merge(inputs=[with_batch, checked])
  return ready


def count_rows(batch_size, cross) -> tf.Tensor:
  """Every task's rows this step in rank order (int64 [tasks]), for a batch
  not taken by `take_batch`."""
  with tf.name_scope("rows_over_tasks"):
    return cross.gather(tf.cast(tf.reshape(batch_size, [1]), tf.int64))


def _rows_if_any(optional, has_value, types, shapes):
  """The batch's rows (dimension 0 of its first batched part), or 0."""
  ranked = [i for i, shape in enumerate(shapes)
            if shape.rank is None or shape.rank >= 1]
  if not ranked:
    return tf.cast(has_value, tf.int64)  # a batch of scalars: one row

  def rows():
    value = tf.raw_ops.OptionalGetValue(
        optional=optional, output_types=types, output_shapes=shapes)
    return tf.shape(value[ranked[0]], out_type=tf.int64)[0]

  return tf.cond(has_value, rows, lambda: tf.constant(0, tf.int64))


class _StopIfAnyEnded:
  """Raises StopIteration (OutOfRangeError) when some task's input ended.

  Calls each of `on_stop` first (a list filled later, while the session's
  hooks are made).
  """

  def __init__(self, tasks, on_stop=()):
    self._tasks = ["{}:{}".format(job, index) for job, index in tasks]
    self._on_stop = on_stop

  def __call__(self, ended):
    done = [task for task, flag in zip(self._tasks, ended) if flag]
    if done:
      for callback in self._on_stop:
        callback()
      message = ("replicate: the input of {} ended; every task of the "
                 "synchronous cluster stops at this step.".format(
                     ", ".join(done)))
      tf.compat.v1.logging.info(message)
      raise StopIteration(message)
    return np.int64(0)
