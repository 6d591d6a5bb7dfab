"""Index ops keep rows apart exactly when they map each row to itself.

`replicate.graph.index_layout` gives the row facts of an index op's
outputs from its inputs'; `reason(layout, op)` here says why the op
combines rows, or None where each output row is made from the same input
row only:
- a gather (`Gather`, `GatherV2`, `GatherNd`, a `SparseSegment*`'s data)
  along the rows' axis passes when its indices are each entry's own row
  position (`tf.range(rows)`, `tf.where(mask)` of a row mask, a sparse
  tensor's `indices[:, 0]`, their order-kept selections); indices of
  another kind move rows to other rows (`tf.gather(h, tf.range(n - 1, -1,
  -1))` reverses them, as `tf.reverse(h, [0])` does);
- a scatter (`ScatterNd`) or a segment op (`UnsortedSegment*`,
  `SparseSegment*`) into an output with one entry per row passes when the
  row each value goes to is the row it comes from; one into an output
  without rows (a confusion matrix, per-class sums keyed by labels) sums
  over the rows (passed where only metrics read it, whose totals are sums
  over the towers: `replicate.shard.rows_meet` skips what only metrics
  read; refused elsewhere);
- `Where`, `Unique`, `DynamicPartition`, `DynamicStitch` and the sparse
  ops of feature columns (`SparseCross*`, `SparseReshape`,
  `SparseFillEmptyRows`, ...) select or label entries: their outputs carry
  the rows' labels on.
A tensor whose rows' axis is UNKNOWN is taken as possibly along a gather's
axis 0 (or an axis not known) and a scatter's, unless the indices are each
entry's own row position.
"""

from typing import Optional

from replicate.graph import index_layout
from replicate.graph.index_layout import gather_axis, positions_for, same_rows
from replicate.graph.row_facts import (
    BPOS, NONE, NO_ROWS, ROW, UNKNOWN, UNKNOWN_ROWS)


SUMS_ROWS = "it sums the rows' values into entries keyed by {}"


def _gather_reason(layout, op) -> Optional[str]:
  if op.type == "ResourceGather":
    return None
  params, indices = layout.fact(op.inputs[0]), layout.fact(op.inputs[1])
  axis, batch_dims = gather_axis(op)
  if params.kind == NONE:
    return None
  if params.kind == UNKNOWN:
    return None  # rows the analysis lost: not refused, as before it
  if axis is None:
    if indices.ids in (ROW, BPOS):
      return None
    return ("it takes entries along an axis that may be the rows' by "
            "indices that are not each row's own position")
  if params.axis == axis and not positions_for(params, indices, None):
    return ("it takes rows by indices that are not each row's own position "
            "(a reversal, a shuffle, rows chosen by value)")
  if params.axis != axis and params.axis >= batch_dims and (
      indices.kind != NONE) and not (params.axis < axis and
                                     same_rows(params, indices)):
    return "it pairs each row's indices with every row's values"
  return None


def _gather_nd_reason(layout, op) -> Optional[str]:
  params, indices = layout.fact(op.inputs[0]), layout.fact(op.inputs[1])
  if params.kind == NONE:
    return None
  if layout.fact(op.outputs[0]) != UNKNOWN_ROWS:
    return None
  if params.kind == UNKNOWN:
    return None  # rows the analysis lost: not refused, as before it
  return ("it takes entries of rows by index tuples whose row part is not "
          "each entry's own row")


def _scatter_reason(layout, op) -> Optional[str]:
  out = layout.fact(op.outputs[0])
  if out.carries:
    return None
  indices, updates = layout.fact(op.inputs[0]), layout.fact(op.inputs[1])
  if indices.kind == NONE and updates.kind == NONE:
    return None
  if out.kind == NONE:
    return SUMS_ROWS.format("the indices")
  return ("it scatters values to rows given by indices that are not each "
          "value's own row")


def _segment_reason(layout, op) -> Optional[str]:
  out = layout.fact(op.outputs[0])
  if out.carries:
    return None
  named = op.op_def.input_arg
  data = layout.fact(op.inputs[0])
  if named[1].name == "indices":  # SparseSegment*: data taken by indices
    indices, segment_ids = (layout.fact(t) for t in op.inputs[1:3])
    if data.kind != NONE and not positions_for(data, indices, None):
      return ("it takes rows by indices that are not each row's own "
              "position")
  else:
    indices, segment_ids = NO_ROWS, layout.fact(op.inputs[1])
  if NONE == data.kind == segment_ids.kind == indices.kind:
    return None
  if out.kind == NONE:
    return SUMS_ROWS.format("segment ids that are not the rows' own "
                            "positions (the rows' values)")
  return "its segment ids are not each row's own position"


RULES = {
    **dict.fromkeys(["Gather", "GatherV2"], _gather_reason),
    "GatherNd": _gather_nd_reason,
    "ScatterNd": _scatter_reason,
    **dict.fromkeys(index_layout.SEGMENT_TYPES +
                    index_layout.SPARSE_SEGMENT_TYPES, _segment_reason),
}


def reason(layout, op) -> Optional[str]:
  """Why `op` (an index op) combines rows, or None."""
  rule = RULES.get(op.type)
  return None if rule is None else rule(layout, op)
