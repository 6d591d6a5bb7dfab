"""Which of a tower's values are computed from a count of its rows.

On why: the towers' per-row tensors put together along their rows are the
whole batch's only if nothing in them counts the tower's rows: not their
values (`tf.range(tf.shape(x)[0])` holds positions in the tower's shard,
`tf.one_hot(..., depth=n)` a column per row of it), and not the size of
another axis (`[rows, rows]`). `replicate.outputs.whole_batch` builds such
a value again instead.

On how: a count of rows is an entry of a shape-like value that the row
analysis says counts them (`tf.shape(x)[0]`, not `tf.shape(x)[1]`; a
constant TensorFlow folded from one on a batch of known size), or of a
`Shape` or `Size` whose entries it cannot tell; positions among the rows
are a `Where` of them. The walk stops at a value whose entries are told. A value's values count
rows if one is behind it through inputs that carry values; inputs that
only give its output's shape (a `Reshape`'s shape, a `Fill`'s dims, a
slice's bounds, a `Tile`'s multiples) or pick which values it holds (a
gather's indices, a cond's predicate, a loop's counter, a list's index)
count for its shape only. One pass over the ops asked, memoized: linear in the graph.
"""

from replicate.graph import op_types
from replicate.graph.row_facts import ROWS, ROWS_K, ROWS_PLUS, SELECTED_COUNT

# Ops whose values count the rows, or are positions among them.
_POSITIONS = (op_types.SHAPE_TYPES - {"Rank"}) | {"Where"}
# What an entry of a shape-like value that counts rows is.
_COUNTS = (ROWS, ROWS_K, ROWS_PLUS, SELECTED_COUNT)
# The inputs of an op that are its output's sizes, axis by axis.
_SIZES = {"Reshape": (1,), "BroadcastTo": (1,), "Fill": (0,), "Tile": (1,),
          "Slice": (1, 2), "StridedSlice": (1, 2, 3),
          **dict.fromkeys(op_types.RANDOM_OF_SHAPE_TYPES, (0,))}
_STRIDED_MASKS = ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")
_GATHERS = frozenset(["GatherV2", "Gather", "GatherNd", "ResourceGather"])
# The inputs of an op that give its output's shape, not its values.
_SHAPE_INPUTS = {
    "Reshape": (1,), "BroadcastTo": (1,), "Fill": (0,), "Tile": (1,),
    "ExpandDims": (1,), "Pad": (1,), "PadV2": (1,), "MirrorPad": (1,),
    "Slice": (1, 2), "StridedSlice": (1, 2, 3), "Transpose": (1,),
    "ConcatV2": (-1,), "Squeeze": (), "ZerosLike": (0,), "OnesLike": (0,),
    # Which rows a gather picks, or where a scatter puts them: positions
    # that select values (`gather_nd(x, where(mask))` holds x's).
    "GatherV2": (1, 2), "Gather": (1,), "GatherNd": (1,),
    "ResourceGather": (1,), "ScatterNd": (0, 2),
    # Which branch or step: a cond's predicate, a loop's counter and its
    # bound (`i < tf.shape(x)[0]`), a list's size and the index it reads.
    "Switch": (1,), "RefSwitch": (1,), "If": (0,), "StatelessIf": (0,),
    "TensorArrayV3": (0,), "TensorArrayReadV3": (1,),
    "TensorArrayWriteV3": (1,), "TensorArrayGatherV3": (1,),
    "TensorArrayScatterV3": (1,), "TensorListReserve": (0, 1),
    "TensorListFromTensor": (1,), "TensorListGetItem": (1, 2),
    "TensorListSetItem": (1,), "TensorListStack": (1,),
    "TensorListGather": (1, 2),
    # A random draw of a shape (dropout's mask of `tf.shape(x)`).
    **dict.fromkeys(op_types.RANDOM_OF_SHAPE_TYPES, (0,)),
}


class RowCounts:
  """Over `within` (a tower's ops), with `depends(values)` the rows rule
  and `fact(tensor)` the row analysis (`replicate.graph.row_layout`)."""

  def __init__(self, within, depends, fact):
    self._within = within
    self._depends = depends
    self._fact = fact
    self._values = {}  # op -> whether its outputs' values count rows
    self._shapes = {}  # op -> whether their values or shapes do

  def values(self, op) -> bool:
    return self._walk(op, self._values, shape_inputs=False)

  def shapes(self, op) -> bool:
    return self._walk(op, self._shapes, shape_inputs=True)

  def _known(self, op):
    """Whether `op`'s outputs count rows, if the analysis knows what each
    entry of them counts (a shape, `tf.shape(x)[1]`); None if it does not."""
    if op.type in _POSITIONS and op.type not in op_types.SHAPE_TYPES:
      return self._depends(op.inputs)  # positions among the rows
    dims = [self._fact(t).dims for t in op.outputs]
    if not dims or any(d is None for d in dims):
      if op.type in op_types.SHAPE_TYPES:
        return self._depends(op.inputs)  # entries not told: may count
      return None
    return any(entry in _COUNTS for d in dims for entry in d)

  def _walk(self, start, memo, shape_inputs):
    """Post-order over the ops behind `start`, without recursion; it
    stops at values whose entries the analysis tells."""
    stack, expanded = [(start, False)], set()
    while stack:
      op, ready = stack.pop()
      if op in memo:
        continue
      known = self._known(op) if op in self._within else False
      if known is not None:
        memo[op] = known
        continue
      inputs = self._inputs(op, shape_inputs)
      if ready:
        memo[op] = any(memo.get(t.op, False) for t in inputs)
        continue
      if op in expanded:
        continue  # a TF 1 loop's back edge: its other inputs decide
      expanded.add(op)
      stack.append((op, True))
      stack.extend((t.op, False) for t in inputs if t.op not in memo)
    return memo[start]

  def _inputs(self, op, shape_inputs):
    inputs = list(op.inputs)
    if shape_inputs:
      return [t for index, t in enumerate(inputs)
              if not self._counts_own_rows(op, index)]
    if op.type not in _SHAPE_INPUTS:
      return inputs
    skipped = {index % len(inputs) for index in _SHAPE_INPUTS[op.type]
               } if inputs else set()
    return [t for index, t in enumerate(inputs) if index not in skipped]

  def _counts_own_rows(self, op, index) -> bool:
    """Whether input `index` of `op` gives its output's shape and counts
    rows only along the output's rows: sizes axis by axis that count
    them only at the output's rows' axis (`tf.zeros([tf.shape(x)[0],
    units])`), or a gather's indices with rows along one axis and known
    sizes elsewhere (each row's own positions). The towers' values are
    put together along that axis."""
    tensor = op.inputs[index]
    if index in _SIZES.get(op.type, ()):
      if op.type == "StridedSlice" and any(
          op.get_attr(mask) for mask in _STRIDED_MASKS):
        return False
      out = self._fact(op.outputs[0])
      dims = self._fact(tensor).dims
      return out.carries and dims is not None and all(
          entry not in _COUNTS for axis, entry in enumerate(dims)
          if axis != out.axis)
    if op.type in _GATHERS and index == 1:
      fact = self._fact(tensor)
      return fact.carries and tensor.shape.rank is not None and all(
          size is not None for axis, size in enumerate(
              tensor.shape.as_list()) if axis != fact.axis)
    return False
