"""A task whose batch is empty builds the towers of any other task.

On why: a task's batch may be empty at a step (uneven input); its towers
then run the `model_fn` on 0 rows, and their gradients count for nothing
(`replicate.gradients.weighting`). Most ops take 0 rows; `SparseReshape`
to a shape with a -1 does not ("reshape cannot infer the missing input
size for an empty tensor"), and TensorFlow's feature columns make one in
every linear model's and every weighted categorical column's lookup
(`sparse_reshape(ids, [rows, -1])`). One device never meets it, since the
concatenated batches have rows; so on a tower built from an empty batch,
a `SparseReshape` whose input has no elements gets its -1 filled in (the
input's non-zero sizes over the other non-zero sizes asked for, at least
1): its output is empty all the same, and every shape after it what it
would be.
"""

from typing import Iterable

import tensorflow as tf

from replicate import _tf


def guard_sparse_reshapes(ops: Iterable[tf.Operation]) -> None:
  """Fills in the -1 of every `SparseReshape` among `ops` whose input is
  empty when it runs, in place."""
  for op in ops:
    if op.type != "SparseReshape" or not _may_infer(op.inputs[2]):
      continue
    input_shape, new_shape = op.inputs[1], op.inputs[2]
    with op.graph.as_default(), op.graph.colocate_with(op), \
        tf.compat.v1.name_scope(op.name + "_if_empty"):
      ones = tf.ones_like(input_shape)
      given = tf.reduce_prod(tf.where(input_shape > 0, input_shape, ones))
      asked = tf.reduce_prod(tf.where(new_shape > 0, new_shape,
                                      tf.ones_like(new_shape)))
      inferred = tf.maximum(given // tf.maximum(asked, 1), 1)
      empty = tf.equal(tf.reduce_prod(input_shape), 0)
      filled = tf.where(tf.logical_and(empty, tf.equal(new_shape, -1)),
                        tf.fill(tf.shape(new_shape), inferred), new_shape)
    _tf.update_input(op, 2, filled)


def _may_infer(new_shape: tf.Tensor) -> bool:
  """Whether the shape asked for may hold a -1 (a constant without one
  cannot)."""
  value = tf.get_static_value(new_shape)
  return value is None or -1 in list(value)
