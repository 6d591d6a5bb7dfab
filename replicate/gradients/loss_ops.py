"""What the loss rule asks of single ops: one number, zeros, reductions
over every axis or over the batch axis, reciprocals, and counts of the rows
TensorFlow folded into constants with a batch of known size (see
`replicate.gradients.loss_rule`)."""

import re

import tensorflow as tf

from replicate.shard import batch_reductions

PASS = ("Identity", "Snapshot")
SHAPED = ("Reshape", "Squeeze", "ExpandDims")
DIVS = ("RealDiv", "Div", "DivNoNan", "TrueDiv")
# What `tf.compat.v1.losses` and Keras name the size of the losses, which
# TensorFlow folds into a constant of that name with a batch of known size.
# `ones_like` of a row tensor of known shape is a `Fill` of such a shape,
# named `shape_as_tensor`.
FOLDED_COUNT = re.compile(
    r"(num_elements|num_present|Size|Shape|shape_as_tensor|ones_like|"
    r"zeros_like)(_[0-9]+)?")
# How many ops up a denominator is searched for a folded count.
COUNT_SEARCH = 64


def one_element(t) -> bool:
  shape = t.shape
  return shape.rank is not None and shape.is_fully_defined() and (
      shape.num_elements() == 1)


def is_scalar(t) -> bool:
  return one_element(t)


def is_zero(t) -> bool:
  if t.op.type == "ZerosLike":
    return True
  if t.op.type == "Const":
    value = tf.get_static_value(t)
    return value is not None and not value.any()
  return False


def reduces_all(op) -> bool:
  """Whether the `Sum`/`Mean` `op` reduces its input to one value."""
  x = op.inputs[0]
  if one_element(op.outputs[0]) and x.shape.rank is not None:
    axes = tf.get_static_value(op.inputs[1])
    if axes is None:
      return False
    rank = x.shape.rank
    wanted = set(range(rank))
    got = {int(a) % rank for a in list(axes.reshape(-1))} if rank else set()
    # An axis left out must have size 1.
    return all(a in got or x.shape[a] == 1 for a in wanted)
  return False


def reduces_batch_axis(op) -> bool:
  """Whether `op` reduces axis 0 of its input (a partial reduction over
  rows, whose result a sum or mean over "rows" would misread)."""
  if op.type not in ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any"):
    return False
  if op.inputs[0].shape.rank == 0:
    return True  # a reduction of a value already over the batch
  # Axes known only when run: possibly the batch's.
  return batch_reductions.over_batch_axis(op) is not False


def reciprocal_of(t):
  op = t.op
  if op.type in ("Reciprocal", "Inv"):
    return op.inputs[0]
  if op.type in DIVS and is_constant(op.inputs[0]):
    return op.inputs[1]
  return None


def is_constant(t) -> bool:
  return tf.get_static_value(t) is not None and not folded_count(t)


def folded_count(t) -> bool:
  """A constant TensorFlow folded from the size or shape of a row tensor."""
  while t.op.type in PASS + ("Cast",):
    t = t.op.inputs[0]
  return t.op.type == "Const" and FOLDED_COUNT.fullmatch(
      t.op.name.split("/")[-1]) is not None


def from_folded_count(t) -> bool:
  """Whether `t` is computed from a constant folded from a row tensor's
  size or shape (a few ops up at most)."""
  seen = {t.op}
  frontier = [t.op]
  while frontier and len(seen) < COUNT_SEARCH:
    op = frontier.pop()
    if op.type == "Const" and folded_count(op.outputs[0]):
      return True
    for x in op.inputs:
      if x.op not in seen:
        seen.add(x.op)
        frontier.append(x.op)
  return False


def first_of_shape(t) -> bool:
  """`shape(x)[0]`: the number of rows of `x`."""
  op = t.op
  source = op.inputs[0]
  if not (source.op.type == "Shape" or folded_count(source)):
    return False
  begin = tf.get_static_value(op.inputs[1])
  end = tf.get_static_value(op.inputs[2])
  return (begin is not None and end is not None and list(begin) == [0] and
          list(end) == [1])


_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike")


def of_shapes(t, reaches_rows) -> bool:
  """Whether `t` reaches the rows only through their shapes (`Shape`,
  `Size`, `OnesLike`, ...), not their values; False when unsure."""
  seen = set()
  frontier = [t]
  while frontier:
    x = frontier.pop()
    if x.op in seen or x.op.type in _SHAPE_OPS or not reaches_rows(x):
      continue
    seen.add(x.op)
    onward = [y for y in x.op.inputs if reaches_rows(y)]
    if not onward or len(seen) > 4 * COUNT_SEARCH:
      return False  # a row tensor itself, or too far to tell
    frontier.extend(onward)
  return True
