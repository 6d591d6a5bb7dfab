"""Edits of a tower's built write ops: to change nothing, or to change
nothing where the tower has no rows.

Editing built ops is kept to the inputs of write ops (a value, or an
ordering), in the fewest places.
"""

import tensorflow as tf

from replicate import _tf
from replicate.state import op_kinds


def as_dtype_of(value, like):
  """`value` in `like`'s dtype, rounded to the nearest for an integer."""
  if like.dtype.is_floating:
    return value
  return tf.cast(tf.math.round(value), like.dtype)


def check_rewritable(op):
  if _tf.built_in_control_flow(op) or op.graph.building_function:
    raise ValueError(
        "The write {!r} is built inside control flow (a tf.cond, a while "
        "loop or a tf.function), where replicate_model_fn cannot combine "
        "the towers' writes or make them once. Build it outside control "
        "flow (for batch norm: pass a Python bool as training).".format(
            op.name))


def change_nothing(op, after):
  """Makes a write leave its variable as it is, once `after` have run."""
  check_rewritable(op)
  after = list(after or [])
  if op_kinds.WRITE_KINDS[op.type] == "set":
    with tf.control_dependencies(after):
      value = read(op)
  else:
    value = tf.zeros_like(op.inputs[1])
  _tf.update_input(op, 1, value)
  for other in after:
    _tf.add_control_input(op, other)


def change_nothing_unless_rows(op, has_rows, index):
  """Where the tower may have no rows, its write changes nothing then."""
  if op.type not in op_kinds.WRITE_KINDS:
    raise ValueError(
        "Tower {}'s op {!r} ({}) changes state from the tower's rows, but "
        "the batch's size is known only when the step runs, so the tower "
        "may run on a stand-in row (a batch with fewer rows than towers), "
        "where replicate can undo only a variable's assign or assign_add. "
        "Fix: make the change with assign_add outside the tf.function, or "
        "give the input_fn a static batch (.batch(b, "
        "drop_remainder=True)).".format(index, op.name, op.type))
  check_rewritable(op)
  value = op.inputs[1]
  if op_kinds.WRITE_KINDS[op.type] == "set":
    unchanged = read(op)
  else:
    unchanged = tf.zeros_like(value)
  _tf.update_input(op, 1, tf.where(has_rows, value, unchanged))


def read(write_op):
  """The current value of the variable `write_op` writes."""
  target = write_op.inputs[0]
  if target.dtype == tf.resource:
    return tf.raw_ops.ReadVariableOp(resource=target,
                                     dtype=write_op.get_attr("dtype"))
  return tf.identity(target)
