"""What a shard of known size tells the row analysis: constants (a shape
TensorFlow folded counts the rows, `tf.ones_like(x)` folded is ones),
`tf.range` of the known row count, and blocks of rows reshaped back
between known sizes."""

from typing import Optional

import numpy as np
import tensorflow as tf

from replicate.graph.row_facts import (
    ALIGNED, BLOCKED, NO_ROWS, ROW, ROWS, UNKNOWN_ROWS, Fact, static)


def positions(op, static_rows) -> Optional[Fact]:
  """`tf.range(batch_size)` of a static shard: `batch_size` is the
  Python number of a static shape (BERT's `gather_indexes` takes it from
  `get_shape_list`), so the range is a constant; 0, 1, ... up to the
  tower's known row count is each row's own position, as `tf.range(
  tf.shape(x)[0])` is when the count is known only when run. A limit
  computed from a shape (`tf.unstack(tf.shape(x))[1]` folded) is not
  taken this way: the shape says which axis it counts. (A constant range
  as the part of index tuples along their rows is read where they are
  built: `index_layout.tuple_part`.)"""
  if static_rows is None or op.inputs[1].op.type != "Const" or (
      constant_fact(op.inputs[1], static_rows).dims != (static_rows,)):
    return None  # a limit taken from a shape is followed as any other
  value = tf.get_static_value(op.outputs[0])
  if value is None or not np.array_equal(np.ravel(value),
                                         np.arange(static_rows)):
    return None
  return Fact(ALIGNED, 0, ids=ROW)


def unblocked(op, fact, static_rows) -> Fact:
  """Blocks of rows back to rows between known sizes (`[rows * k, w]`
  to `[rows, k, w]`: a dense layer's `Tensordot` on a batch of known
  size), the new first size the tower's known row count."""
  if op.inputs[0].shape.rank is None or op.outputs[0].shape.rank is None:
    return UNKNOWN_ROWS
  sizes, dims = op.inputs[0].shape.as_list(), op.outputs[0].shape.as_list()
  if (fact.kind != BLOCKED or fact.axis != 0 or static_rows is None or
      not sizes or not dims or None in sizes or None in dims or
      dims[0] != static_rows or sizes[0] % static_rows or
      int(np.prod(sizes[1:])) * (sizes[0] // static_rows) != int(
          np.prod(dims[1:]))):
    return UNKNOWN_ROWS
  return fact._replace(kind=ALIGNED, axis=0, dims=None, ones=False,
                       block=None)


def filled_fact(tensor: tf.Tensor) -> Fact:
  """A value without rows of rank 2 or more: whether it is all ones.

  `tf.ones_like(x)` and `tf.ones(shape)` of a known shape are a constant
  below 1000 entries and a `Fill` of the number 1 from there on (TF-Ranking's
  index tuples `tf.ones_like(indices) * tf.expand_dims(tf.range(rows), 1)`
  on lists of 100 items): either way x * it is x. The fill's value is read,
  not the filled tensor (which may be large)."""
  value = static(tensor.op.inputs[1]) if tensor.op.type == "Fill" else None
  return Fact(ones=value == [1])


def constant_fact(tensor: tf.Tensor, static_rows) -> Fact:
  """A constant (or a value without rows): its entries as known numbers.

  A shape TensorFlow folded to a constant (`tf.shape(x)` of a static
  shape) keeps the name `Shape` but not `x`: its first entry, if equal to
  the static row count, is taken for the rows (rows lead the tensors a
  model takes shapes of; `tf.shape(x)[1]` of the same size is a number).
  """
  shape_like = tensor.dtype.is_integer and tensor.shape.rank in (0, 1)
  if not shape_like and tensor.op.type != "Const":
    return NO_ROWS
  value = tf.get_static_value(tensor)
  if value is None:
    return NO_ROWS
  if not shape_like:  # `tf.ones_like(x)` folded: x * it is x
    value = np.asarray(value)
    return Fact(ones=bool(value.size and value.dtype.kind in "biuf" and
                          np.all(value == 1)))
  values = np.ravel(value).tolist()
  folded = (tensor.op.type == "Const" and
            tensor.op.name.split("/")[-1].split("_")[0] in ("Shape", "Size"))
  dims = tuple(ROWS if folded and i == 0 and v == static_rows else int(v)
               for i, v in enumerate(values))
  ones = bool(values) and all(v == 1 for v in values)
  return Fact(dims=dims, ones=ones)
