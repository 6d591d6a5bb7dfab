"""The op types that combine rows of the batch in some patterns: the rules.

Each rule takes `rows_meet`'s finder (which tensors hold the tower's rows
along dimension 0, which are computed from what rows hold rather than from
their positions, which are a candidate sampler's draws; `finder.layout`, the
row analysis, for the index ops of `replicate.graph.index_rules`) and the
op, and
returns why the op combines rows, or None where it keeps them apart (a
matmul of rows by weights, attention's batched matmuls within a row, the
segment sums of embedding columns keyed by each row's own index, linear
algebra on matrices that are each a row's). `rows_meet` refuses the op with
the reason and the fix.

On loops: a TF 1 loop's body is in the graph, each of its ops judged there
on the facts the row analysis finds through the loop's frame; a TF 2
`While`'s body is a function, each of its ops judged by the same rules on
the body's facts at the loop's fixpoint (`InBody`). A loop over the
batch's rows (`x[i]` at each step) is refused under both.
"""

import types
from typing import Optional

import numpy as np
import tensorflow as tf

from replicate import graph_walk
from replicate.graph import index_layout
from replicate.graph import index_rules
from replicate.graph import op_types
from replicate.graph import slice_rules
from replicate.graph.row_facts import NONE, UNKNOWN


def named_inputs(op):
  """(argument name, tensor) of each input; list arguments repeat a name
  (`SparseCross`'s `indices`, `values`, `shapes`, `dense_inputs`: their
  lengths are the op's number and type-list attributes)."""
  names = []
  for arg in op.op_def.input_arg:
    if arg.number_attr:
      count = op.get_attr(arg.number_attr)
    elif arg.type_list_attr:
      count = len(op.get_attr(arg.type_list_attr))
    else:
      count = 1
    names.extend([arg.name] * count)
  inputs = list(op.inputs)
  if len(names) != len(inputs):  # not expected: no name rather than a wrong one
    names = [""] * len(inputs)
  return list(zip(names, inputs))


def _matmul(finder, op):
  """A matmul of two tensors with rows: the batch axis of one meets the
  other's (`a @ b^T` is [rows, rows]; `a^T @ b` sums over rows)."""
  a, b = op.inputs[0], op.inputs[1]
  if a.shape.rank != 2 or b.shape.rank != 2:
    return None  # batched matmuls keep dimension 0 apart (attention)
  if (finder.carries_rows(a) and finder.carries_rows(b) and
      not finder.sampled(a) and not finder.sampled(b)):
    return "both operands hold rows of the batch along dimension 0"
  return None


def _einsum(finder, op):
  """`tf.einsum` of two tensors with rows whose batch axes (each operand's
  first subscript) differ (`'id,jd->ij'`: [rows, rows]) or are summed
  away (`'id,id->d'`); a shared batch axis kept in the output (`'bij,bjk->
  bik'`) keeps rows apart, as batched matmuls do."""
  if len(op.inputs) != 2 or not all(
      finder.carries_rows(t) and not finder.sampled(t) for t in op.inputs):
    return None
  operands, _, output = op.get_attr("equation").decode().partition("->")
  subscripts = operands.split(",")
  if len(subscripts) != 2 or any(not sub or sub.startswith(".")
                                 for sub in subscripts):
    return None  # the batch axis under an ellipsis is aligned, kept apart
  first, second = subscripts[0][0], subscripts[1][0]
  if first != second:
    return "the two operands' batch axes ({!r}, {!r}) meet".format(
        first, second)
  if first not in output:
    return "it sums over the batch axis {!r}".format(first)
  return None


def _top_k(finder, op):
  """`top_k`, `sort`, `argsort` over the batch axis: along a vector of one
  value per row, or along dimension 0 moved last by a transpose."""
  values = op.inputs[0]
  if values.shape.rank == 1 and finder.carries_rows(values):
    return "it ranks a vector of one value per row against each other"
  if _batch_axis_moved_last(finder, values):
    return "it ranks along the batch axis, moved last by a transpose"
  return None


def _softmax(finder, op):
  """A softmax (or its cross entropy) along the batch axis: of a vector of
  one value per row, or `tf.nn.softmax(x, axis=0)` (dimension 0 moved last
  by a transpose). Along a row's own last axis it keeps rows apart."""
  values = op.inputs[0]
  while values.op.type == "Reshape":  # the cross entropy's 2-D view
    values = values.op.inputs[0]
  if values.shape.rank == 1 and finder.carries_rows(values):
    return "it normalises a vector of one value per row over the batch"
  if _batch_axis_moved_last(finder, values):
    return "it normalises along the batch axis, moved last by a transpose"
  return None


def _batch_axis_moved_last(finder, values) -> bool:
  """`values` has the rows along its last axis: by the row analysis (a
  `tf.sort(tf.transpose(x), axis=1)` negates the transpose first), or a
  transpose of values with rows that moves axis 0 last (its permutation's
  last entry: known, or the last part of a concat)."""
  fact = finder.layout.fact(values)
  rank = values.shape.rank
  if fact.carries and rank and rank > 1 and fact.axis == rank - 1:
    return True
  if values.op.type != "Transpose" or not finder.carries_rows(
      values.op.inputs[0]):
    return False
  perm = values.op.inputs[1]
  last = tf.get_static_value(perm)
  if last is None and perm.op.type == "ConcatV2":
    last = tf.get_static_value(perm.op.inputs[-2])
  last = None if last is None else np.ravel(last)
  return last is not None and len(last) > 0 and int(last[-1]) == 0


def _cumulative(finder, op):
  """A cumulative sum/product of values of the rows down the batch axis.

  Integer cumulative sums are bookkeeping of positions (a ragged tensor's
  row splits): not refused.
  """
  if not op.inputs[0].dtype.is_floating:
    return None
  return _along_rows_axis(finder, op.inputs[0], tf.get_static_value(
      op.inputs[1]), "it accumulates down the batch axis")


_SEGMENT_TYPES = frozenset(index_layout.SEGMENT_TYPES +
                           index_layout.SPARSE_SEGMENT_TYPES)


def _index(finder, op):
  """Gathers, scatters and segment ops: `replicate.graph.index_rules`, by
  where each row goes (`finder.layout`, the row analysis).

  A segment op whose rows the analysis lost (a `SparseTensor` of unknown
  rank that `safe_embedding_lookup_sparse` flattens by the product of its
  shape's leading entries; feature columns' lookups on a batch of known
  size; a crossed column of a bucketized one) is not refused, as a gather
  of lost rows is not: the rule before the analysis refused crossed
  columns there, keying their ids by the rows' values.
  """
  why = index_rules.reason(finder.layout, op)
  if why and op.type in _SEGMENT_TYPES and (
      finder.layout.fact(op.outputs[0]).kind == UNKNOWN):
    return None
  return why


def _matrices(finder, op):
  """Linear algebra on the last two axes, the axes before them a batch: per
  row when the batch axis is one of those (rank >= 3); a vector or matrix
  of the rows' values (not only of their shape) has it as a matrix axis."""
  for tensor in op.inputs:
    if ((tensor.shape.rank is None or tensor.shape.rank < 3) and
        finder.carries_rows(tensor) and finder.from_row_values(tensor)):
      return "it takes the batch axis as a matrix axis"
  return None


def _sparse_matmul(finder, op):
  """`tf.sparse.sparse_dense_matmul`: a sparse tensor of rows times weights
  is per row; its transpose (sums over rows) or a dense operand with rows
  combines them."""
  if op.get_attr("adjoint_a") and finder.rows.depend(op.inputs[:3]):
    return "it multiplies the transpose of a sparse tensor of the rows"
  if finder.carries_rows(op.inputs[3]):
    return "its dense operand holds rows of the batch along dimension 0"
  return None


def _along_batch(finder, op):
  """`tf.roll` and `tf.reverse` of values with rows along the batch axis
  (shifted negatives: `tf.roll(d, 1, axis=0)`); other axes keep rows apart,
  axis 0 of a time-major transpose too (a Keras backward RNN)."""
  return _along_rows_axis(finder, op.inputs[0], tf.get_static_value(
      op.inputs[-1]), "it moves rows along the batch axis")


def _along_rows_axis(finder, values, axis, why) -> Optional[str]:
  """`why` if `axis` (a number or a list, None: not known) is the axis of
  `values` that holds the rows: 0, where a transpose moved it, or where
  the row analysis follows them (a time-major loop's `[time, rows, d]`
  outputs, reversed along time)."""
  where, fact = 0, finder.layout.fact(values)
  if fact.carries and fact.axis != 0:
    where = fact.axis
  elif values.op.type == "Transpose" and finder.carries_rows(
      values.op.inputs[0]):
    perm = tf.get_static_value(values.op.inputs[1])
    where = None if perm is None else np.ravel(perm).tolist().index(0)
  elif not finder.carries_rows(values):
    return None
  rank = values.shape.rank
  axes = None if axis is None else np.ravel(axis).tolist()
  if where is None or axes is None or (rank is None and
                                       any(a < 0 for a in axes)):
    return "its axis is not known when the graph is built"
  if any((a % rank if rank else a) == where for a in axes):
    return why
  return None


def _loop(finder, op):
  """A TF 2 `tf.while_loop`: the ops of its body, each judged by its rule
  as outside it (`InBody` reads the body's layout at the loop's
  fixpoint). A TF 1 loop's body is in the graph, each op judged there:
  the same decisions under both control flows."""
  body = finder.layout.loop_body(op)
  if body is None:
    return None
  inner = InBody(body[1], body[0], finder.tower_rows)
  for body_op in body[0]:
    rule = ROW_COMBINING.get(body_op.type)
    why = rule and rule(inner, body_op)
    if why:
      return "its body's {} op {!r}: {}".format(body_op.type, body_op.name,
                                                why)
  return None


def leads_with_rows(tensor, tower_rows) -> bool:
  """Whether `tensor`'s dimension 0 may hold rows: it has one, not of
  size 1 where the tower has more rows than that (a value reduced over
  the batch to one row)."""
  if tensor.shape.rank == 0:
    return False
  first = tensor.shape[0]
  first = getattr(first, "value", first)  # TF 1 behaviour's Dimension
  return not (first == 1 and tower_rows != 1)


class InBody:
  """What the rules ask of a tensor of a TF 2 loop's body (a function: no
  tensor of the tower's graph), read from the body's row analysis."""

  def __init__(self, layout, ops, tower_rows):
    self.layout = layout
    self.tower_rows = tower_rows
    self.rows = types.SimpleNamespace(depend=self._depend)
    self._ops = frozenset(ops)

  def _depend(self, tensors) -> bool:
    return any(self.layout.fact(t).kind != NONE for t in tensors)

  def carries_rows(self, tensor) -> bool:
    return self._depend([tensor]) and leads_with_rows(tensor,
                                                      self.tower_rows)

  def from_row_values(self, tensor) -> bool:
    return self.carries_rows(tensor)

  def sampled(self, tensor) -> bool:
    return any(op.type in op_types.SAMPLER_TYPES for op in
               graph_walk.ops_behind([tensor], within=self._ops))


# The op types that combine rows in some patterns, each with its rule.
ROW_COMBINING = {
    **dict.fromkeys(["MatMul", "BatchMatMul", "BatchMatMulV2",
                     "BatchMatMulV3"], _matmul),
    "Einsum": _einsum,
    **dict.fromkeys(["TopKV2", "TopK"], _top_k),
    **dict.fromkeys(["Cumsum", "Cumprod", "CumulativeLogsumexp"],
                    _cumulative),
    **dict.fromkeys(index_rules.RULES, _index),
    **dict.fromkeys(["Roll", "ReverseV2"], _along_batch),
    "SparseTensorDenseMatMul": _sparse_matmul,
    **slice_rules.RULES,
    **dict.fromkeys(["While", "StatelessWhile"], _loop),
    **dict.fromkeys(["Softmax", "LogSoftmax",
                     "SoftmaxCrossEntropyWithLogits"], _softmax),
    **dict.fromkeys([
        "MatrixBandPart", "MatrixDiag", "MatrixDiagV2", "MatrixDiagV3",
        "MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3",
        "MatrixSetDiag", "MatrixSetDiagV2", "MatrixSetDiagV3",
        "MatrixInverse", "MatrixDeterminant", "LogMatrixDeterminant",
        "Cholesky", "Qr", "Svd", "SelfAdjointEigV2", "Eig", "Lu",
        "MatrixSolve", "MatrixTriangularSolve", "MatrixSolveLs",
        "MatrixExponential", "MatrixLogarithm", "MatrixSquareRoot"],
                    _matrices),
}
