"""How the sparse ops of feature columns move the rows: a `SparseTensor`
whose `indices[:, 0]` are each entry's own row keeps them through
`SparseCross*`, `SparseReshape` to `[rows, -1]`, `SparseFillEmptyRows`,
`SparseReorder`, a `SparseSlice` from row 0; `StringSplit` of a vector of
rows makes one."""

from replicate.graph.row_facts import (
    ALIGNED, NONE, OTHER, ROW, ROWS, SELECTED, UNKNOWN_ROWS, Fact, dims_of,
    static)


def _sparse_rows(indices: Fact) -> bool:
  return indices.ids == ROW and indices.component == 0


def _sparse_out(op, ok, shape_dims=None):
  """(indices, values, shape) facts of a sparse op's new sparse tensor."""
  if not ok:
    return [UNKNOWN_ROWS] * len(op.outputs)
  source = op.outputs[0].ref()
  facts = [Fact(SELECTED, 0, source, ROW, 0), Fact(SELECTED, 0, source),
           Fact(dims=shape_dims)]
  return facts[:len(op.outputs)] + [UNKNOWN_ROWS] * (len(op.outputs) - 3)


def _sparse_cross(op, inputs):
  count = op.get_attr("N")
  indices, dense = inputs[:count], inputs[3 * count:]
  dense = dense[:len(op.get_attr("dense_types"))]
  ok = (all(_sparse_rows(f) or f.kind == NONE for f in indices) and
        all(f.kind == NONE or (f.kind == ALIGNED and f.axis == 0)
            for f in dense))
  return _sparse_out(op, ok, (ROWS, OTHER))


def _sparse_reshape(op, inputs):
  new = dims_of(inputs[2], op.inputs[2])
  if not (_sparse_rows(inputs[0]) and new and new[0] == ROWS):
    return [UNKNOWN_ROWS, Fact(dims=None)]
  dims = tuple(OTHER if d == -1 else d for d in new)
  return [inputs[0], Fact(dims=dims)]


def _fill_empty_rows(op, inputs):
  ok = _sparse_rows(inputs[0])
  facts = _sparse_out(op, ok)[:2]
  if not ok:
    return facts + [UNKNOWN_ROWS, UNKNOWN_ROWS]
  return facts + [Fact(ALIGNED, 0), inputs[0]._replace(ids=None,
                                                       component=None)]


def _sparse_reorder(op, inputs):
  return _sparse_out(op, _sparse_rows(inputs[0]))[:2]


def _sparse_slice(op, inputs):
  start = static(op.inputs[3])
  return _sparse_out(op, _sparse_rows(inputs[0]) and bool(start) and
                     start[0] == 0)


def _string_split(op, inputs):
  text = inputs[0]
  return _sparse_out(op, text.kind == ALIGNED and text.axis == 0,
                     (ROWS, OTHER))


def _sparse_to_dense(op, inputs):
  dims = dims_of(inputs[1], op.inputs[1])
  if _sparse_rows(inputs[0]) and dims and dims[0] == ROWS:
    return [Fact(ALIGNED, 0)]
  return [UNKNOWN_ROWS]


TRANSFER = {
    **dict.fromkeys(["SparseCross", "SparseCrossHashed", "SparseCrossV2"],
                    _sparse_cross),
    "SparseReshape": _sparse_reshape,
    "SparseFillEmptyRows": _fill_empty_rows,
    "SparseReorder": _sparse_reorder,
    "SparseSlice": _sparse_slice,
    **dict.fromkeys(["StringSplit", "StringSplitV2"], _string_split),
    "SparseToDense": _sparse_to_dense,
}
