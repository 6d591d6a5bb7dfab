"""How shape and layout ops move the rows: `tf.shape(x)[0]` told from
`tf.shape(x)[1]` (a shape-like value's entries: ROWS, ROWS_K, known
numbers), `tf.range(rows)`, transposes, expand / squeeze, stack / concat
(reshapes: `replicate.graph.reshape_layout`)."""

import numpy as np

from replicate.graph import index_layout
from replicate.graph.row_facts import (
    ALIGNED, BLOCKED, BPOS, NONE, NO_ROWS, OTHER, ROW, ROWS, ROWS_K,
    ROWS_PLUS, SELECTED, SELECTED_COUNT, UNKNOWN, UNKNOWN_ROWS, Fact, Size,
    dims_of, rank_of, static, with_blocks)


COUNT_ARITHMETIC = frozenset(["Mul", "Add", "AddV2", "Sub", "Maximum"])


def count_arithmetic(op, inputs):
  """Arithmetic on counts: rows * k counts blocks of rows; known numbers
  give known numbers."""
  parts = [dims_of(f, t) for f, t in zip(inputs, op.inputs)]
  if any(p is None or len(p) != 1 for p in parts):
    return NO_ROWS
  a, b = parts[0][0], parts[1][0]
  if isinstance(a, int) and isinstance(b, int):
    value = {"Mul": a * b, "Sub": a - b, "Maximum": max(a, b)}.get(
        op.type, a + b)
    return Fact(dims=(value,))
  counts = {a, b} & {ROWS, ROWS_K}
  if op.type == "Mul" and len(counts) == 1 and None not in (a, b) and (
      SELECTED_COUNT not in (a, b)):
    other = b if a in counts else a
    return Fact(dims=(a if other == 1 else b if a == 1 else ROWS_K,))
  if (counts or ROWS_PLUS in (a, b)) and op.type != "Mul":
    return Fact(dims=(ROWS_PLUS,))  # `n - 1`: a reversal's start
  return Fact(dims=(None,) if counts or ROWS_PLUS in (a, b) else (OTHER,))


def _shape(op, inputs):
  """`tf.shape(x)`: ROWS at x's rows axis, known sizes, OTHER elsewhere."""
  facts = []
  for tensor, fact in zip(op.inputs, inputs):
    rank = rank_of(tensor)
    if rank is None:
      facts.append(Fact(dims=None))
      continue
    dims = []
    for axis, size in enumerate(tensor.shape.as_list()):
      if fact.kind == UNKNOWN:
        dims.append(None)
      elif fact.carries and axis == fact.axis:
        dims.append({ALIGNED: ROWS, BLOCKED: ROWS_K,
                     SELECTED: SELECTED_COUNT}[fact.kind])
      else:
        dims.append(Size((tensor.ref(), axis)) if size is None else size)
    facts.append(Fact(dims=tuple(dims)))
  return facts


def _size(op, inputs):
  fact = inputs[0]
  if op.inputs[0].shape.is_fully_defined():
    return [Fact(dims=(op.inputs[0].shape.num_elements(),))]
  if fact.kind == NONE:
    return [Fact(dims=(OTHER,))]
  return [Fact(dims=(ROWS_K if fact.kind in (ALIGNED, BLOCKED) else None,))]


def _product(dims):
  """What a product of entries counts."""
  if any(d is None for d in dims):
    return None
  rows = [d for d in dims if d in (ROWS, ROWS_K, SELECTED_COUNT)]
  if not rows:
    return OTHER if any(d == OTHER for d in dims) else int(np.prod(dims))
  if len(rows) > 1:
    return None
  others = [d for d in dims if d not in rows]
  if rows[0] == SELECTED_COUNT:
    return SELECTED_COUNT if all(d == 1 for d in others) else None
  return rows[0] if all(d == 1 for d in others) else ROWS_K


def _range(op, inputs):
  """`tf.range(rows)`: each row's own position; another range of the rows'
  count (`tf.range(n - 1, -1, -1)`) runs along them, not at them."""
  start, limit, delta = (dims_of(f, t) for f, t in zip(inputs, op.inputs))
  limit = limit and limit[0]
  if limit not in (ROWS, ROWS_K, ROWS_PLUS) and not any(
      f.kind != NONE or (f.dims and set(f.dims) & {ROWS, ROWS_K, ROWS_PLUS})
      for f in (inputs[0], inputs[2])):
    return [NO_ROWS]  # `tf.range(list_size)`: not along the rows
  kind = ALIGNED if limit == ROWS else BLOCKED
  if start == (0,) and delta == (1,):
    return [Fact(kind, 0, ids=ROW if limit == ROWS else BPOS)]
  if limit in (ROWS, ROWS_K) or ROWS_PLUS in (limit, start and start[0]):
    # As long as the rows, but not each row's own position (reversed,
    # shifted): a gather by it moves rows to other rows.
    return [Fact(ALIGNED if ROWS_K not in (limit,) else BLOCKED, 0)]
  return [UNKNOWN_ROWS]


def _pack(op, inputs):
  axis = op.get_attr("axis")
  rank = rank_of(op.outputs[0])
  if rank == 1 and all(rank_of(t) == 0 for t in op.inputs):
    dims = []
    for fact, tensor in zip(inputs, op.inputs):
      entry = dims_of(fact, tensor)
      dims.append(entry[0] if entry else None)
    if not any(f.carries for f in inputs):
      return [Fact(dims=tuple(dims))]
  if rank is None:
    return None
  axis %= rank
  return [_stacked(op, inputs, axis, axis)]


def _stacked(op, inputs, axis, new_axis):
  """Stack or concat along `axis`: rows keep their axis (shifted past a
  new one); index tuples built along the last axis keep their parts'
  positions (`index_layout.tuple_part`)."""
  found = None
  for index, fact in enumerate(inputs):
    if fact.kind == NONE:
      continue
    if fact.kind == UNKNOWN or (fact.carries and fact.axis == axis and
                                new_axis is None):
      return UNKNOWN_ROWS  # rows joined along their own axis
    moved = fact.moved(fact.axis + (1 if new_axis is not None and
                                    fact.axis >= new_axis else 0))
    if found is None:
      found = moved
    elif index_layout.same_rows(found, moved):
      found = with_blocks(found, moved)
    elif (found.kind, found.axis, found.source) != (moved.kind, moved.axis,
                                                    moved.source):
      return UNKNOWN_ROWS
  if found is None:
    return NO_ROWS
  part = (index_layout.tuple_part(op, inputs, new_axis, found)
          if rank_of(op.outputs[0]) == axis + 1 else None)
  if part is not None:
    return found._replace(ids=part[0], component=part[1])
  return found


def _concat(op, inputs):
  axis = static(op.inputs[-1])
  values, facts = op.inputs[:-1], inputs[:-1]
  rank = rank_of(op.outputs[0])
  if axis is None or rank is None:
    return [UNKNOWN_ROWS]
  axis = axis[0] % rank
  if rank == 1 and axis == 0 and not any(f.carries for f in facts):
    dims = []
    for fact, tensor in zip(facts, values):
      entry = dims_of(fact, tensor)
      if entry is None:
        return [Fact(dims=None)]
      dims.extend(entry)
    return [Fact(dims=tuple(dims))]
  return [_stacked(op, facts, axis, None)]


def _expand_dims(op, inputs):
  fact, axis = inputs[0], static(op.inputs[1])
  if not fact.carries or axis is None or rank_of(op.outputs[0]) is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  axis = axis[0] % rank_of(op.outputs[0])
  moved = fact.moved(fact.axis + (axis <= fact.axis))
  return [moved._replace(ids=fact.ids, component=fact.component)]


def _squeeze(op, inputs):
  fact = inputs[0]
  rank = rank_of(op.inputs[0])
  if not fact.carries or rank is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  dims = [d % rank for d in op.get_attr("squeeze_dims")] or [
      i for i, size in enumerate(op.inputs[0].shape.as_list()) if size == 1]
  if fact.axis in dims:
    return [UNKNOWN_ROWS]
  moved = fact.moved(fact.axis - sum(d < fact.axis for d in dims))
  component = fact.component
  if component == 0 and rank - 1 in dims:
    component = None  # the one column of index tuples squeezed away
  return [moved._replace(ids=fact.ids, component=component,
                         pos_of=fact.pos_of)]


def _transpose(op, inputs):
  fact, perm = inputs[0], static(op.inputs[1])
  if not fact.carries or perm is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  return [fact.moved(perm.index(fact.axis))]


def _gather_dims(op, inputs):
  """A gather of entries of a shape-like vector by known positions."""
  dims, where = inputs[0].dims, static(op.inputs[1])
  if dims is None or where is None or rank_of(op.inputs[0]) != 1:
    return None
  return [Fact(dims=tuple(dims[i] for i in where))]


def _prod(op, inputs):
  if inputs[0].dims is None or rank_of(op.outputs[0]) != 0:
    return None
  return [Fact(dims=(_product(inputs[0].dims),))]


def _unpack(op, inputs):
  """`tf.unstack(tf.shape(x))`: each entry; of rows, along another axis."""
  fact, axis = inputs[0], op.get_attr("axis")
  rank = rank_of(op.inputs[0])
  if fact.dims is not None and rank == 1:
    return [Fact(dims=(d,)) for d in fact.dims][:len(op.outputs)] or None
  if not fact.carries or rank is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS] * len(op.outputs)
  axis %= rank
  if axis == fact.axis:
    return [UNKNOWN_ROWS] * len(op.outputs)  # one row each
  moved = fact.axis - (axis < fact.axis)
  return [fact.moved(moved) for _ in op.outputs]


TRANSFER = {
    "Unpack": _unpack,
    **dict.fromkeys(["Shape", "ShapeN"], _shape),
    "Size": _size,
    "Range": _range,
    "Pack": _pack,
    "ConcatV2": _concat,
    "ExpandDims": _expand_dims,
    "Squeeze": _squeeze,
    "Transpose": _transpose,
    "GatherV2": _gather_dims,
    "Prod": _prod,
}
