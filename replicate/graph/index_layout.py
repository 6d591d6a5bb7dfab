"""How index ops move the rows: gathers, scatters, segment ops, `Where`,
`Unique`, `DynamicPartition` / `DynamicStitch` (see
`replicate.graph.index_rules` for when they combine rows).

A gather along the rows' axis by each entry's own row position is an
order-kept selection: its output keeps the entries' rows (and what their
values say of positions: an index matrix's row part). A scatter or a
segment op whose targets are each value's own row gives one entry per row.
"""

from replicate.graph.row_facts import (
    ALIGNED, BLOCKED, BPOS, NONE, NO_ROWS, OTHER, ROW, ROWS, ROWS_K, SELECTED,
    SPOS, UNKNOWN, UNKNOWN_ROWS, Fact, dims_of, rank_of, static, with_blocks)


# What a gather axis's kind of rows asks of the indices' values.
_IDS_FOR = {ALIGNED: ROW, BLOCKED: BPOS}


_KIND_FOR = {ROW: ALIGNED, BPOS: BLOCKED}


def same_rows(a: Fact, b: Fact) -> bool:
  return (a.kind, a.axis, a.source) == (b.kind, b.axis, b.source)


def gather_axis(op):
  if op.type == "GatherV2":
    axis = static(op.inputs[2])
    if axis is None:
      return None, 0
    rank = rank_of(op.inputs[0])
    axis = axis[0] % rank if rank else axis[0]
  else:
    axis = 0
  try:
    batch_dims = op.get_attr("batch_dims")
  except ValueError:
    batch_dims = 0
  return axis, batch_dims


def _gather(op, inputs):
  params = NO_ROWS if op.type == "ResourceGather" else inputs[0]
  indices = inputs[1]
  axis, batch_dims = gather_axis(op)
  if axis is None or params.kind == UNKNOWN or indices.kind == UNKNOWN:
    return [UNKNOWN_ROWS if NONE not in (params.kind, indices.kind) or
            UNKNOWN in (params.kind, indices.kind) else NO_ROWS]
  index_rank = rank_of(op.inputs[1])
  if params.kind == NONE:
    if indices.kind == NONE:
      return [NO_ROWS]
    return [indices.moved(axis + indices.axis - batch_dims)]
  if params.axis == axis:
    if positions_for(params, indices, None):
      # An order-kept selection: each entry keeps its row, and what its
      # values say of positions (an index matrix's row part).
      moved = with_blocks(indices.moved(axis + indices.axis - batch_dims),
                          params)
      return [moved._replace(ids=params.ids, component=params.component,
                             pos_of=params.pos_of)]
    return [UNKNOWN_ROWS]
  if params.axis < axis:
    if indices.kind == NONE or (params.axis < batch_dims and
                                same_rows(params, indices)):
      return [params.moved(params.axis)]
    return [UNKNOWN_ROWS]
  if indices.kind == NONE and index_rank is not None:
    return [params.moved(params.axis + index_rank - batch_dims - 1)]
  return [UNKNOWN_ROWS]


def tuple_part(op, inputs, new_axis, rows=None):
  """(ids, component) of index tuples that a stack (`new_axis`) or a concat
  `op` of parts builds along the last axis, from the first part holding
  positions: its own component (or 0) past the parts before it (tfa's CRF
  score's `(row, 0)` then the tag; `LSTMBlockFusedCell`'s final states by
  `(length, row)`); None if not such tuples. `rows`: the tuples' rows
  (along their first axis): a part that is the constant 0, 1, ... along
  it (`tf.range(batch_size)` of a known size) holds each tuple's own
  position there."""
  index = next((i for i, f in enumerate(inputs)
                if f.ids or _counts_along(f, op.inputs[i], rows)), None)
  if index is None:
    return None
  part, tensor = inputs[index], op.inputs[index]
  if not part.ids:
    part = Fact(rows.kind, 0, ids=_IDS_FOR[rows.kind])
  widths = [1 if new_axis is not None else
            t.shape.as_list()[-1] if rank_of(t) else None
            for t in op.inputs[:index]]
  if None in widths or (part.component is not None and new_axis is not None):
    return None
  if part.component is None and new_axis is None and not (
      rank_of(tensor) and tensor.shape.as_list()[-1] == 1):
    return None
  return part.ids, sum(widths) + (part.component or 0)


def _counts_along(fact, tensor, rows) -> bool:
  """`tensor` is the constant 0, 1, ..., n - 1 along a first axis of n
  entries that holds `rows` (ALIGNED or BLOCKED): each entry's own
  position along the rows' axis."""
  if (rows is None or rows.kind not in _IDS_FOR or rows.axis != 0 or
      fact.kind != NONE or fact.dims is None or rank_of(tensor) != 1):
    return False
  size = tensor.shape.as_list()[0]
  return size is not None and size > 0 and fact.dims == tuple(range(size))


def positions_for(params: Fact, indices: Fact, component) -> bool:
  """The indices' values (or their `component`) are each entry's own
  position along the params' rows axis."""
  if params.kind == SELECTED:
    return (indices.ids == SPOS and indices.pos_of == params.source and
            indices.component == component)
  wanted = _IDS_FOR.get(params.kind)
  return (wanted is not None and indices.ids == wanted and
          indices.component == component and indices.kind != NONE)


def _gather_nd(op, inputs):
  params, indices = inputs[0], inputs[1]
  depth = op.inputs[1].shape[-1] if rank_of(op.inputs[1]) else None
  index_rank = rank_of(op.inputs[1])
  if UNKNOWN in (params.kind, indices.kind) or depth is None:
    return [NO_ROWS if params.kind == indices.kind == NONE else UNKNOWN_ROWS]
  if params.kind == NONE:
    if indices.kind == NONE:
      return [NO_ROWS]
    if indices.axis >= index_rank - 1:
      return [UNKNOWN_ROWS]
    return [indices.moved(indices.axis)]
  if params.axis < depth:
    if (positions_for(params, indices, params.axis) and
        indices.axis < index_rank - 1):
      moved = with_blocks(indices.moved(indices.axis), params)
      if params.component is not None and (
          rank_of(op.inputs[0]) or 0) - 1 >= depth:
        # Whole index tuples taken: their row part stays their row.
        moved = moved._replace(ids=params.ids, component=params.component,
                               pos_of=params.pos_of)
      return [moved]
    return [UNKNOWN_ROWS]
  if indices.kind == NONE:
    return [params.moved(index_rank - 1 + params.axis - depth)]
  return [UNKNOWN_ROWS]


def _scatter_nd(op, inputs):
  indices, updates, shape = inputs
  dims = dims_of(shape, op.inputs[2])
  if dims is None or None in dims:
    return [UNKNOWN_ROWS]
  counts = [i for i, d in enumerate(dims) if d in (ROWS, ROWS_K)]
  if not counts:
    return [NO_ROWS]  # a sum over rows into entries without rows
  kind = ALIGNED if dims[counts[0]] == ROWS else BLOCKED
  out = Fact(kind, counts[0])
  if (len(counts) == 1 and positions_for(out, indices, counts[0]) and
      (updates.kind == NONE or same_rows(indices, updates))):
    return [out]
  return [UNKNOWN_ROWS]


def _segment_output(op, data, segment_ids, num):
  """Output of a segment op: the segments are the rows when each id is
  its entry's own row (or blocked position)."""
  if segment_ids.kind == UNKNOWN or data.kind == UNKNOWN:
    return UNKNOWN_ROWS
  if segment_ids.ids in _KIND_FOR and segment_ids.component is None:
    kind = _KIND_FOR[segment_ids.ids]
    wanted = ROWS if kind == ALIGNED else ROWS_K
    if num is None or num == wanted:
      return Fact(kind, 0)
    return UNKNOWN_ROWS
  if data.kind == NONE and segment_ids.kind == NONE:
    return NO_ROWS
  seg_rank = rank_of(op.inputs[1]) or 0
  if segment_ids.kind == NONE and data.carries and data.axis >= seg_rank:
    return data.moved(data.axis - seg_rank + 1)
  return NO_ROWS if num not in (ROWS, ROWS_K) else UNKNOWN_ROWS


def _num_segments(op, fact_index, inputs):
  if len(op.inputs) <= fact_index:
    return None
  dims = dims_of(inputs[fact_index], op.inputs[fact_index])
  return dims[0] if dims else OTHER


def ragged_row_ids(tensor) -> bool:
  """A `RaggedTensor`'s `value_rowids()` (its row partition's bookkeeping,
  named so by TensorFlow): each value's own row. The analysis does not
  follow how a row partition computes them (cumulative sums, searches),
  so it takes TensorFlow's name scopes for it, as the rule did before."""
  name = tensor.op.name
  return tensor.dtype.is_integer and ("RowPartition" in name or
                                      "Ragged" in name)


def _unsorted_segment(op, inputs):
  if ragged_row_ids(op.inputs[1]):  # a ragged reduction over each row
    return [Fact(ALIGNED, 0)]
  return [_segment_output(op, inputs[0], inputs[1],
                          _num_segments(op, 2, inputs))]


def _sparse_segment(op, inputs):
  data, indices, segment_ids = inputs[:3]
  if data.kind == UNKNOWN or (data.carries and data.axis == 0 and
                              not positions_for(data, indices, None)):
    return [UNKNOWN_ROWS]
  if data.kind != NONE and data.axis != 0:
    return [UNKNOWN_ROWS]
  return [_segment_output(op, NO_ROWS, segment_ids,
                          _num_segments(op, 3, inputs))]


def _where(op, inputs):
  if len(op.inputs) != 1:
    return None
  mask = inputs[0]
  if mask.kind == NONE:
    return [NO_ROWS]
  if not mask.carries:
    return [UNKNOWN_ROWS]
  ids = _IDS_FOR.get(mask.kind, SPOS)
  kind = SELECTED if mask.axis == 0 else UNKNOWN
  return [Fact(kind, 0 if kind == SELECTED else None, op.outputs[0].ref(),
               ids, mask.axis, pos_of=mask.source)]


def _unique(op, inputs):
  """`y`: the tower's distinct values (keyed, no rows; a gather by `idx`
  gives each entry back at its row); `idx`: laid out as the input."""
  value = inputs[0]
  return [NO_ROWS, value._replace(ids=None, component=None, dims=None)]


def _partition(op, inputs):
  data = inputs[0]
  if data.kind == NONE:
    return [NO_ROWS] * len(op.outputs)
  if data.carries and data.axis == 0:
    return [Fact(SELECTED, 0, t.ref(), data.ids, data.component)
            for t in op.outputs]
  return [UNKNOWN_ROWS] * len(op.outputs)


def _stitch(op, inputs):
  return [NO_ROWS if all(f.kind == NONE for f in inputs) else UNKNOWN_ROWS]


SEGMENT_TYPES = (
    "UnsortedSegmentSum", "UnsortedSegmentProd", "UnsortedSegmentMax",
    "UnsortedSegmentMin", "SegmentSum", "SegmentMean", "SegmentProd",
    "SegmentMax", "SegmentMin")
SPARSE_SEGMENT_TYPES = (
    "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
    "SparseSegmentSqrtNWithNumSegments")


TRANSFER = {
    **dict.fromkeys(["Gather", "GatherV2", "ResourceGather"], _gather),
    **dict.fromkeys(["GatherNd", "ResourceGatherNd"], _gather_nd),
    "ScatterNd": _scatter_nd,
    **dict.fromkeys(SEGMENT_TYPES, _unsorted_segment),
    **dict.fromkeys(SPARSE_SEGMENT_TYPES, _sparse_segment),
    "Where": _where,
    **dict.fromkeys(["Unique", "UniqueV2"], _unique),
    "DynamicPartition": _partition,
    **dict.fromkeys(["DynamicStitch", "ParallelDynamicStitch"], _stitch),
}
