"""`replicate.all_rows` and `replicate.row_offset`: rows that meet.

On why: a value that combines different rows of the batch (in-batch
negatives `tf.matmul(a, b, transpose_b=True)`) is, in a tower, combined over
the tower's shard only; `replicate.shard.rows_meet` refuses such ops. The fix
is to give each tower the whole batch's rows of the tensor it combines with:
`all_rows(b)` is `b` of every tower, concatenated in input order, and
`row_offset()` the index in the batch of the tower's first row.

On how: each tower's calls are recorded and joined once every tower is
built (`replicate.towers.all_rows_calls`): the forward pass concatenates
every tower's rows, the backward pass sums every tower's gradient with
respect to them and gives each tower its own rows of the sum.

On synchronous clusters (TRAIN): the whole batch is every task's, in rank
order (the chief's rows, then worker 0's, ...), as the concatenated batch
one device is given; `row_offset()` counts the rows of the tasks before
this one (`replicate.cluster.rows_over_tasks`). EVAL and PREDICT run on one
task's own towers, so there `all_rows` is that machine's batch.
"""

from typing import Any, List

import tensorflow as tf

from replicate.call import current
from replicate.cluster import rows_over_tasks
from replicate import _tf


def all_rows(tensor: Any) -> tf.Tensor:
  """The whole batch's rows of `tensor` (the tower's rows in dimension 0).

  In input order, on the tower's device (in a synchronous cluster's TRAIN
  step, every task's rows in rank order); the gradient with respect to the
  result flows back to each tower's own rows, summed over the towers (of
  every task) that used them. Outside `replicate_model_fn` or with one
  tower: `tensor`.
  """
  context = _context("all_rows")
  tensor = tf.convert_to_tensor(tensor)
  if context is None:
    return tensor
  if tensor.shape.rank == 0:
    raise ValueError(
        "replicate.all_rows({!r}) needs a tensor with the tower's rows in "
        "dimension 0; this one is a scalar. Fix: pass a tensor of shape "
        "[rows, ...].".format(tensor.name))
  if context.layout.spans_tasks:
    rows_over_tasks.check_dtype(tensor)
  return context.all_rows.gather(context, tensor)


def row_offset() -> tf.Tensor:
  """The int32 index in the whole batch of the tower's first row.

  In a synchronous cluster's TRAIN step, after every row of the tasks
  before this one. 0 outside `replicate_model_fn` or with one tower. A
  tower built on a stand-in row (no rows of its own) gets 0, the stand-in's
  row.
  """
  context = _context("row_offset")
  if context is None:
    return tf.constant(0, tf.int32)
  return tf.identity(first_row(context.layout, context.progress.tower_index),
                     name="row_offset")


def first_row(layout, index: int) -> tf.Tensor:
  """The index in the whole batch of tower `index`'s first row (int32);
  0 for a tower without rows."""
  local = tf.cast(_offsets(layout.shards.sizes)[index], tf.int32)
  if not layout.spans_tasks:
    return local
  has_rows = layout.has_rows[index]
  if has_rows is False:
    return local
  start = rows_over_tasks.task_start(layout) + local
  return start if has_rows is True else tf.where(has_rows, start, local)


def _context(what):
  """The context of a multi-tower build, None outside one, or refused."""
  graph = tf.compat.v1.get_default_graph()
  if getattr(graph, "outer_graph", None) is not None:
    if any(current.current_context(outer) is not None
           for outer in _tf.enclosing_graphs(graph)):
      raise ValueError(
          "replicate.{}() is called inside a tf.function, a TF 2 tf.cond or "
          "tf.while_loop of a tower. Its value joins every tower's, which a "
          "function graph cannot. Fix: call it in the model_fn itself and "
          "pass the result in.".format(what))
    return None
  context = current.current_context(graph)
  if context is None:
    return None
  if context.progress.tower_index is None or not context.layout.combines:
    return None
  return context


def _offsets(sizes) -> List[Any]:
  """Each tower's first row; a tower without rows gets 0, as its stand-in."""
  if isinstance(sizes, list):
    return [sum(sizes[:i]) if size else 0 for i, size in enumerate(sizes)]
  starts = tf.where(sizes > 0, tf.cumsum(sizes, exclusive=True), 0)
  return tf.unstack(starts, num=tf.compat.dimension_value(sizes.shape[0]))
