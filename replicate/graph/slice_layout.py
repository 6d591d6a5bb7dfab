"""How slices move the rows: `x[:n]`, `x[:, 0]` keep them where the
slice keeps their axis from its start with step 1; of a shape-like vector
(`tf.shape(x)[1:]`), a slice picks its entries; of index tuples
(`tf.where(mask)[:, 0]`), a column picks their row part."""

from replicate.graph.row_facts import (
    NONE, NO_ROWS, UNKNOWN_ROWS, Fact, dims_of, rank_of, static)


def _strided_slice(op, inputs):
  """A slice keeps the rows where it keeps their axis from its start with
  step 1 (`x[:n]`, `x[:, 0]`); picks entries of a shape-like vector."""
  fact = inputs[0]
  begin, end, strides = (static(t) for t in op.inputs[1:4])
  if begin is None or strides is None:
    return None
  masks = {name: op.get_attr(name + "_mask") for name in (
      "begin", "end", "ellipsis", "new_axis", "shrink_axis")}
  rank = rank_of(op.inputs[0])
  if fact.dims is not None and rank == 1:
    return [_sliced_dims(fact.dims, begin, end, strides, masks)]
  if fact.kind == NONE:
    return [NO_ROWS]
  if not fact.carries or rank is None:
    return [UNKNOWN_ROWS]
  mapping = slice_axes(rank, len(begin), masks)
  if mapping is None:
    return [UNKNOWN_ROWS]
  result = None
  for in_axis, out_axis, spec in mapping:
    if in_axis == fact.axis:
      if out_axis is None:
        return [NO_ROWS]  # one row picked: not along the rows any more
      starts = spec is None or masks["begin"] >> spec & 1 or begin[spec] == 0
      if spec is not None and (not starts or strides[spec] != 1):
        return [UNKNOWN_ROWS]
      result = fact.moved(out_axis)
  if result is None:
    return [UNKNOWN_ROWS]
  if fact.ids and fact.component is None:
    return [result._replace(ids=fact.ids)]  # `tf.range(rows)[:n]`
  if fact.component is not None and rank - 1 != fact.axis:
    last = [m for m in mapping if m[0] == rank - 1][0]
    if last[1] is None and last[2] is not None and (
        begin[last[2]] == fact.component):
      return [result._replace(ids=fact.ids)]
    if last[1] is not None and (last[2] is None or begin[last[2]] == 0 and
                                strides[last[2]] == 1):
      return [result._replace(ids=fact.ids, component=fact.component)]
  return [result]


def slice_axes(rank, count, masks):
  """(input axis, output axis or None if shrunk, spec index or None)."""
  mapping, in_axis, out_axis = [], 0, 0
  specs = list(range(count))
  if not masks["ellipsis"]:
    specs.append("...")
  for spec in specs:
    if spec == "..." or masks["ellipsis"] >> spec & 1:
      rest = sum(1 for s in specs[specs.index(spec) + 1:]
                 if s != "..." and not masks["new_axis"] >> s & 1)
      while in_axis < rank - rest:
        mapping.append((in_axis, out_axis, None))
        in_axis, out_axis = in_axis + 1, out_axis + 1
    elif masks["new_axis"] >> spec & 1:
      out_axis += 1
    elif masks["shrink_axis"] >> spec & 1:
      mapping.append((in_axis, None, spec))
      in_axis += 1
    else:
      mapping.append((in_axis, out_axis, spec))
      in_axis, out_axis = in_axis + 1, out_axis + 1
  return mapping if in_axis == rank else None


def _sliced_dims(dims, begin, end, strides, masks):
  if masks["shrink_axis"] & 1:
    try:
      return Fact(dims=(dims[begin[0]],))
    except IndexError:
      return Fact(dims=None)
  if masks["ellipsis"] or masks["new_axis"]:
    return Fact(dims=None)
  start = None if masks["begin"] & 1 else begin[0]
  stop = None if masks["end"] & 1 or end is None else end[0]
  return Fact(dims=tuple(dims[start:stop:strides[0]]))


def _slice(op, inputs):
  """`tf.slice`: of a shape-like vector, its entries; of rows, the rows
  kept where the slice starts at their axis's start."""
  fact, begin = inputs[0], static(op.inputs[1])
  size = dims_of(inputs[2], op.inputs[2])
  if fact.dims is not None and rank_of(op.inputs[0]) == 1:
    if begin is None or size is None or not isinstance(size[0], int):
      return [Fact(dims=None)]
    stop = None if size[0] == -1 else begin[0] + size[0]
    return [Fact(dims=fact.dims[begin[0]:stop])]
  if not fact.carries:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  if begin is None or begin[fact.axis] != 0:
    return [UNKNOWN_ROWS]
  return [fact.moved(fact.axis)._replace(ids=fact.ids,
                                         component=fact.component)]


def entries(vector, count):
  """Each entry of an integer vector, None where not known when built (a
  `tf.stack` of numbers and tensors: `x[i, 0]`'s begin is `[i, 0]`)."""
  value = static(vector)
  if value is not None:
    return value
  if vector.op.type == "Pack" and len(vector.op.inputs) == count:
    return [(static(t) or [None])[0] for t in vector.op.inputs]
  return [None] * count


TRANSFER = {"StridedSlice": _strided_slice, "Slice": _slice}
