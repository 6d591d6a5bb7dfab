"""How a tower's loss is reduced over its rows, read from the graph.

On the rule: the loss is taken apart into additive terms, through the ops
that keep it linear in them (`Identity`, `Cast`, `Reshape`, `Squeeze`,
`Add`, `AddV2`, `AddN`, `Sub`, `Neg`, and `Mul`, `RealDiv`, `DivNoNan` by
a value not computed from the rows). Each term is one of:
- `SUM`: a sum over rows (`Sum` of a row tensor to a scalar, `L2Loss`);
  one device's loss is the towers' sum, so it counts as it is;
- `MEAN`: a mean over rows (`Mean` of a row tensor to a scalar, over
  inner axes too, of fixed or varying size); it counts as the tower's sum
  divided by the number of elements of every tower;
- `RATIO`: `s / d` (`RealDiv`, `DivNoNan`, or `s * (1 / d)`) with `s` a
  sum over rows and `d` a sum or count over rows (`reduce_sum(w)`,
  `count_nonzero(w)`, `tf.size`, `tf.shape(x)[0]`, or what TensorFlow
  folded them into with a batch of known size); it counts as `s` divided
  by every tower's `d` summed. This is every `tf.compat.v1.losses`
  reduction but SUM, and a Keras loss's SUM_OVER_BATCH_SIZE. Also `s / c`
  with `c` a constant equal to the tower's static row count, where that
  differs from the whole batch's (`reduce_sum(xent) / x.shape[0]`,
  `tf.cast(x.shape[0], ...)`, `int(x.shape[0])` with a batch of known
  size, which TensorFlow makes a constant): on one device `c` is the
  batch's row count, so `c` is read as the tower's count of rows, a mean
  over rows. A constant that is the same on one device (a hyperparameter
  equal to the whole batch's size, `/ params["batch_size"]`) differs from
  the tower's count and stays a scale of a sum. (A hyperparameter that
  equals the tower's count, not the batch's, is read as the count: state
  `replicate.loss_denominator` or `loss_reduction` to say otherwise);
- `ONCE`: not computed from the rows (regularization, a constant): the
  same in every tower, counted once over the towers.
Anything else is not read, and the caller refuses it or, where the user
stated the reduction, weighs the term as stated (`STATED`).

On exactness: a `MEAN` or `RATIO` term is rebuilt as the tower's sum over
the total of every tower, never as the tower's own mean times a weight, so
a tower whose rows are all padding adds exactly 0 (its own `0 / 0` is not
on the path), and the gradient is one device's whatever the shards' sizes.

"From the rows" is `replicate.shard.rows`'s rule; this module also takes a
constant TensorFlow folded from the size of a row tensor under the name the
loss libraries give it (`num_elements`) as a count of the rows.
"""

from typing import Callable, List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from replicate.gradients import loss_ops

SUM = "a sum over rows"
MEAN = "a mean over rows"
RATIO = "a sum over rows divided by a sum or count over rows"
ONCE = "not computed from the rows"
STATED = "not read from the graph"

class NotRead(Exception):
  """The op that makes a term the rule cannot read, and why."""

  def __init__(self, op: tf.Operation, why: str):
    super().__init__(why)
    self.op = op
    self.why = why


class Term(NamedTuple):
  kind: str
  tensor: tf.Tensor  # the term as the tower computes it
  # What every tower's value is summed of, for MEAN (its element count)
  # and RATIO (its denominator); None otherwise.
  count: Optional[tf.Tensor]
  numerator: Optional[tf.Tensor]  # RATIO: `s`; MEAN: the `Mean`'s input
  # RATIO: its count is computed from shapes only (no data path from the
  # rows): each tower's is its number of elements, as a mean's.
  of_shapes: bool = False


class Reading(NamedTuple):
  """A loss taken apart: its terms and how to put it back together."""
  terms: List[Term]
  tree: tuple

  def kinds(self) -> List[str]:
    return [term.kind for term in self.terms]

  def build(self, contributions: List[tf.Tensor]) -> tf.Tensor:
    """The loss with term k replaced by `contributions[k]`."""
    return _build(self.tree, contributions)


def read(loss: tf.Tensor, depends: Callable[[tf.Tensor], bool],
         lenient: bool = False, reaches_rows=None,
         row_count: Optional[int] = None) -> Reading:
  """Reads `loss`; raises `NotRead` unless `lenient` (then `STATED`).

  `reaches_rows(t)`: whether `t` has a data path from the rows, not only
  from a constant folded from a shape; a term not read that has none is
  the same in every tower (a cond on a variable's size): `ONCE`.
  `row_count`: the tower's static row count where it differs from the
  whole batch's, else None (a constant divisor equal to it is a count).
  """
  terms: List[Term] = []
  reader = _Reader(depends, lenient, terms)
  reader.reaches_rows = reaches_rows
  reader.row_count = row_count
  tree = reader.walk(tf.convert_to_tensor(loss))
  return Reading(terms, tree)


class _Reader:

  def __init__(self, depends, lenient, terms):
    self._depends = depends
    self._lenient = lenient
    self._terms = terms
    self.reaches_rows = None
    self.row_count = None

  def _leaf(self, term):
    self._terms.append(term)
    return ("term", len(self._terms) - 1)

  def walk(self, t: tf.Tensor) -> tuple:
    if not self._depends(t):
      return self._leaf(Term(ONCE, t, None, None))
    try:
      return self._linear(t)
    except NotRead:
      if self.reaches_rows is not None and not self.reaches_rows(t):
        return self._leaf(Term(ONCE, t, None, None))
      if not self._lenient:
        raise
      return self._leaf(Term(STATED, t, None, None))

  def _linear(self, t):
    op = t.op
    kind = op.type
    _check_scalar(t)
    if kind in loss_ops.PASS:
      return self.walk(op.inputs[0])
    if kind == "Cast" and op.inputs[0].dtype.is_floating:
      return ("cast", self.walk(op.inputs[0]), t.dtype)
    if (kind in loss_ops.SHAPED and loss_ops.one_element(op.inputs[0])) or (
        kind in ("Sum", "Mean") and op.inputs[0].shape.rank == 0):
      # Also a sum or mean of a scalar (`_safe_mean` sums a sum again).
      return ("shape", self.walk(op.inputs[0]), t)
    if kind in ("Add", "AddV2", "AddN"):
      return ("add", [self.walk(x) for x in op.inputs])
    if kind == "Sub":
      return ("sub", self.walk(op.inputs[0]), self.walk(op.inputs[1]))
    if kind == "Neg":
      return ("neg", self.walk(op.inputs[0]))
    if kind == "Mul":
      return self._product(t)
    if kind in loss_ops.DIVS:
      return self._quotient(t)
    if kind in ("Select", "SelectV2") and loss_ops.is_zero(op.inputs[2]):
      return self._guarded(t)
    return self._leaf(self._reduction(t))

  def _product(self, t):
    a, b = t.op.inputs
    if not self._depends(a) and loss_ops.is_scalar(a):
      return ("mul", self.walk(b), a)
    if not self._depends(b) and loss_ops.is_scalar(b):
      return ("mul", self.walk(a), b)
    for s, r in ((a, b), (b, a)):
      d = loss_ops.reciprocal_of(r)
      if d is not None and loss_ops.is_scalar(r):
        return self._ratio(t, s, d)
    raise NotRead(t.op, "it multiplies two values computed from the rows")

  def _quotient(self, t):
    s, d = t.op.inputs
    if not self._is_count_like(d):
      if self._is_row_count(d):
        return self._ratio(t, s, d, of_rows=True)
      if not self._depends(d):
        return ("div", self.walk(s), d, t.op.type)
    if not self._depends(s):
      raise NotRead(t.op, "it divides a value not computed from the rows "
                    "by one that is")
    return self._ratio(t, s, d)

  def _is_row_count(self, d) -> bool:
    """A constant equal to the tower's static row count (see the module
    docstring)."""
    if self.row_count is None or not loss_ops.one_element(d):
      return False
    value = tf.get_static_value(d)
    return value is not None and float(np.ravel(value)[0]) == self.row_count

  def _ratio(self, t, s, d, of_rows=False):
    numerator = _Reader(self._depends, False, [])
    try:
      numerator_tree = numerator.walk(s)
    except NotRead as e:
      raise NotRead(t.op, "its numerator is not a sum over rows ({} {!r}: "
                    "{})".format(e.op.type, e.op.name, e.why))
    if any(term.kind != SUM for term in numerator._terms):
      raise NotRead(t.op, "its numerator is not a sum over rows")
    del numerator_tree
    if of_rows:  # the tower's row count, a constant: a mean over rows
      return self._leaf(Term(RATIO, t, d, s, True))
    self._check_count(t.op, d)
    of_shapes = self.reaches_rows is not None and loss_ops.of_shapes(
        d, self.reaches_rows)
    return self._leaf(Term(RATIO, t, d, s, of_shapes))

  def _guarded(self, t):
    # `where(cond, loss, zeros)` (mean_pairwise_squared_error): a sum over
    # rows that is 0 wherever `cond` is false, the guard is the sum itself.
    inner = t.op.inputs[1]
    reader = _Reader(self._depends, False, [])
    reader.walk(inner)
    if all(term.kind in (SUM,) for term in reader._terms):
      return ("select", self.walk(inner), t)
    raise NotRead(t.op, "it chooses between values computed from the rows")

  def _reduction(self, t):
    op = t.op
    if op.type == "L2Loss":
      return Term(SUM, t, None, None)
    if op.type in ("Sum", "Mean"):
      x = op.inputs[0]
      if not loss_ops.reduces_all(op):
        raise NotRead(op, "it does not reduce every axis of its input to one "
                      "value")
      if loss_ops.reduces_batch_axis(x.op):
        raise NotRead(op, "its input {!r} is a reduction over the batch "
                      "axis".format(x.op.name))
      if op.type == "Sum":
        return Term(SUM, t, None, None)
      return Term(MEAN, t, None, x)
    raise NotRead(op, "it is not a sum, a mean or a ratio of sums over rows")

  def _is_count_like(self, d):
    return self._depends(d) or loss_ops.from_folded_count(d)

  def _check_count(self, op, d):
    """`d` must add up over towers to one device's: a sum or a count."""
    inner = d
    while inner.op.type in loss_ops.PASS + ("Cast",) or (
        inner.op.type in loss_ops.SHAPED and
        loss_ops.one_element(inner.op.inputs[0])):
      inner = inner.op.inputs[0]
    kind = inner.op.type
    if kind in ("Add", "AddV2", "AddN"):
      for x in inner.op.inputs:
        self._check_count(op, x)
      return
    if kind == "Mul":
      a, b = inner.op.inputs
      if not self._is_count_like(a):
        return self._check_count(op, b)
      if not self._is_count_like(b):
        return self._check_count(op, a)
    if kind == "Sum" and loss_ops.reduces_all(inner.op):
      return
    if kind == "Size" or (kind == "Const" and loss_ops.folded_count(inner)):
      if loss_ops.is_scalar(inner):
        return
    if kind == "StridedSlice" and loss_ops.first_of_shape(inner):
      return
    raise NotRead(op, "it divides by {} {!r}, which is not a sum or a count "
                  "over the rows".format(kind, inner.op.name))


def _build(tree, parts):
  kind = tree[0]
  if kind == "term":
    return parts[tree[1]]
  if kind == "cast":
    return tf.cast(_build(tree[1], parts), tree[2])
  if kind == "shape":
    original = tree[2]
    shape = (original.shape if original.shape.is_fully_defined() else
             tf.shape(original))
    return tf.reshape(_build(tree[1], parts), shape)
  if kind == "add":
    return tf.math.add_n([_build(x, parts) for x in tree[1]])
  if kind == "sub":
    return _build(tree[1], parts) - _build(tree[2], parts)
  if kind == "neg":
    return -_build(tree[1], parts)
  if kind == "mul":
    return _build(tree[1], parts) * tree[2]
  if kind == "div":
    if tree[3] == "DivNoNan":
      return tf.math.divide_no_nan(_build(tree[1], parts), tree[2])
    return _build(tree[1], parts) / tree[2]
  if kind == "select":
    return _build(tree[1], parts)
  raise AssertionError(kind)


def _check_scalar(t):
  if not loss_ops.one_element(t):
    raise NotRead(t.op, "its value is not one number (shape {})".format(
        t.shape))

