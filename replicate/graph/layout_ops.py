"""How each op moves the rows: its outputs' facts from its inputs'.

`replicate.graph.row_layout` calls `transfer(op, inputs)` for each op
computed from the rows (inputs: the facts of `op.inputs`). The tables of
`shape_layout`, `index_layout` and `sparse_layout` and this module's model
the ops whose rows can move; any other type gets `default`: per-row
families keep the rows' axis (elementwise ops with broadcasting, layers on
axis 0), anything else with rows in its inputs is UNKNOWN (possibly along
any axis).
"""

from replicate.graph import index_layout
from replicate.graph.index_layout import same_rows
from replicate.graph import loop_layout
from replicate.graph import reshape_layout
from replicate.graph import row_ops
from replicate.graph import shape_layout
from replicate.graph import slice_layout
from replicate.graph import sparse_layout
from replicate.graph.row_facts import (
    ALIGNED, BLOCKED, BPOS, CARRIES, NONE, NO_ROWS, ROW, ROWS, ROWS_K, STARTS,
    UNKNOWN, UNKNOWN_ROWS, Fact, dims_of, rank_of, static, with_blocks)


_IDENTITY = frozenset("""Identity Snapshot StopGradient PreventGradient
    CheckNumerics CheckNumericsV2 EnsureShape Cast DebugGradientIdentity
    Enter RefEnter Exit RefExit Switch RefSwitch NextIteration
    RefNextIteration""".split())


# Per entry: strings and lookups of feature columns too (a table's handle,
# without rows, broadcasts), a bias added along the last axis.
_ELEMENTWISE = (row_ops.FAMILIES["elementwise"][1] |
                row_ops.FAMILIES["activations"][1] | frozenset("""
    AsString StringJoin Substr StringLower StringUpper StringStrip
    StringLength StringToNumber StringToHashBucket StringToHashBucketFast
    StringToHashBucketStrong RegexReplace RegexFullMatch StaticRegexReplace
    StaticRegexFullMatch Bucketize LookupTableFind LookupTableFindV2
    Softmax LogSoftmax BiasAdd BiasAddV1""".split()))


_PER_EXAMPLE = (row_ops.FAMILIES["layers per example"][1] |
                row_ops.FAMILIES["losses per row"][1] |
                row_ops.FAMILIES["batch norm"][1])


def default(op, inputs):
  if not any(f.kind != NONE for f in inputs):
    if op.type in shape_layout.COUNT_ARITHMETIC and len(op.outputs) == 1:
      return [shape_layout.count_arithmetic(op, inputs)]
    return [NO_ROWS] * len(op.outputs)
  if op.type in _ELEMENTWISE:
    return [_broadcast(op, inputs)]
  if op.type in _PER_EXAMPLE and inputs and inputs[0].kind in CARRIES and (
      inputs[0].axis == 0):
    return [inputs[0].moved(0) if t.shape.rank else NO_ROWS
            for t in op.outputs]
  return [UNKNOWN_ROWS] * len(op.outputs)


def _broadcast(op, inputs):
  """Elementwise with broadcasting: axes align from the last one."""
  out_rank = rank_of(op.outputs[0])
  found = None
  for tensor, fact in zip(op.inputs, inputs):
    if fact.kind == NONE:
      continue
    if fact.kind == UNKNOWN:
      return UNKNOWN_ROWS
    rank = rank_of(tensor)
    if rank is None or out_rank is None:
      if rank != out_rank:
        return UNKNOWN_ROWS
      axis = fact.axis
    else:
      axis = fact.axis + out_rank - rank
    moved = fact.moved(axis)
    if found is None:
      found = moved
    elif same_rows(found, moved):
      found = with_blocks(found, moved)
    elif (found.kind, found.axis, found.source) != (moved.kind, moved.axis,
                                                    moved.source):
      return UNKNOWN_ROWS  # two row axes meet (an outer product of rows)
  ids = _elementwise_ids(op, inputs)
  return found._replace(ids=ids[0], component=ids[1])


def _elementwise_ids(op, inputs):
  """Positions through arithmetic: x * 1 and a cast keep them; rows * k is
  each row's start; a start plus an offset within its row a position, and
  so is a position plus a row's own offset."""
  with_ids = [f for f in inputs if f.ids]
  if len(with_ids) != 1 or with_ids[0].component is not None:
    return None, None
  ids = with_ids[0].ids
  others = [f for f in inputs if not f.ids]
  if op.type == "Mul" and all(f.ones for f in others):
    return ids, None
  if op.type == "Mul" and ids in (ROW, STARTS) and all(
      f.kind == NONE for f in others):
    return STARTS, None  # starts of rows of k (times m: of k * m)
  if op.type in ("AddV2", "Add") and ids == STARTS:
    return BPOS, None
  # A position plus each row's own offset in its block, as a start plus
  # one is (tfa's CRF unary score: starts, plus steps, plus the tags).
  if op.type in ("AddV2", "Add") and ids == BPOS and all(
      f.carries for f in others):
    return BPOS, None
  if op.type == "FloorDiv" and ids == BPOS and all(
      f.kind == NONE for f in others):
    return ROW, None
  return None, None


def _like(op, inputs):
  fact = inputs[0]
  return [fact._replace(ids=None, component=None, dims=None,
                        ones=op.type == "OnesLike")]


def _fill(op, inputs):
  dims = dims_of(inputs[0], op.inputs[0])
  value = static(op.inputs[1])
  if dims is None:
    return [UNKNOWN_ROWS]
  counts = [i for i, d in enumerate(dims) if d in (ROWS, ROWS_K)]
  ones = value == [1]
  if not counts:
    return [Fact(ones=ones)]
  if len(counts) > 1:
    return [UNKNOWN_ROWS]
  kind = ALIGNED if dims[counts[0]] == ROWS else BLOCKED
  return [Fact(kind, counts[0], ones=ones)]


def _tile(op, inputs):
  fact = inputs[0]
  multiples = dims_of(inputs[1], op.inputs[1])
  if multiples is None:
    return [UNKNOWN_ROWS]
  counts = [i for i, d in enumerate(multiples) if d in (ROWS, ROWS_K)]
  if fact.kind == NONE and len(counts) == 1:
    sizes = op.inputs[0].shape.as_list()
    if counts[0] < len(sizes) and sizes[counts[0]] == 1:
      kind = ALIGNED if multiples[counts[0]] == ROWS else BLOCKED
      return [Fact(kind, counts[0], ones=fact.ones)]
    return [UNKNOWN_ROWS]
  if fact.carries and not counts and multiples[fact.axis] == 1:
    return [fact._replace(dims=None)]
  return [fact if fact.kind == NONE and not counts else UNKNOWN_ROWS]


_ARG_REDUCTIONS = frozenset(["ArgMax", "ArgMin"])


def _reduction(op, inputs):
  fact, axes = inputs[0], static(op.inputs[1])
  rank = rank_of(op.inputs[0])
  if not fact.carries or axes is None or rank is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  axes = [a % rank for a in axes]
  if fact.axis in axes:
    return [NO_ROWS]  # over the batch: the batch reductions' rule
  # ArgMax and ArgMin drop their one axis (a CRF's best previous tag).
  if op.type not in _ARG_REDUCTIONS and op.get_attr("keep_dims"):
    return [fact.moved(fact.axis)]
  return [fact.moved(fact.axis - sum(a < fact.axis for a in axes))]


def _merge(op, inputs):
  known = [f for f, t in zip(inputs, op.inputs) if f != UNKNOWN_ROWS]
  fact = known[0] if known else UNKNOWN_ROWS
  return [fact, NO_ROWS]


def _identity(op, inputs):
  if op.type in ("Switch", "RefSwitch"):
    return [inputs[0], inputs[0]]
  return [inputs[0]]


def _identity_n(op, inputs):
  return list(inputs)


def _matmul(op, inputs):
  a, b = inputs[0], inputs[1]
  rank = rank_of(op.inputs[0])
  if a.kind == NONE and b.kind == NONE:
    return [NO_ROWS]
  if b.kind != NONE and not (a.kind != NONE and same_rows(a, b) and
                             rank and a.axis < rank - 2):
    return [UNKNOWN_ROWS]
  transposed = op.type == "MatMul" and op.get_attr("transpose_a")
  if a.carries and rank is not None and (
      (rank == 2 and a.axis == 0 and not transposed) or
      (rank > 2 and a.axis < rank - 2)):
    return [a.moved(a.axis)]
  return [UNKNOWN_ROWS]


def _along(op, inputs):
  """Ops along one axis of their first input (top_k, sorts, roll,
  reverse, cumulative sums): its rows stay where they are (their rules
  refuse the ones along the rows' axis)."""
  fact = inputs[0]
  if not fact.carries:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS] * len(op.outputs)
  return [fact.moved(fact.axis) for _ in op.outputs]


def _one_hot(op, inputs):
  fact = inputs[0]
  axis = op.get_attr("axis")
  if not fact.carries:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  if axis == -1 or axis > fact.axis:
    return [fact.moved(fact.axis)]
  return [fact.moved(fact.axis + 1)]


def _time_major(op, inputs):
  """`BlockLSTM(V2)` (`LSTMBlockFusedCell`): `x` is `[time, rows, d]`, its
  states `[rows, units]`, and each output `[time, rows, units]` (each row's
  sequence through the cell alone): the rows stay on axis 1."""
  x, states = inputs[1], inputs[2:4]
  if not (x.carries and x.axis == 1):
    return None
  if any(f.kind != NONE and not same_rows(f, x.moved(0)) for f in states):
    return None
  return [with_blocks(x.moved(1), *states)
          for _ in op.outputs]


def _select(op, inputs):
  """TF 1 `tf.where(cond, x, y)` with a vector `cond` picks whole rows."""
  cond = inputs[0]
  if (rank_of(op.inputs[0]) == 1 and (rank_of(op.inputs[1]) or 0) > 1 and
      cond.carries and cond.axis == 0):
    rest = [f for f in inputs[1:] if f.kind != NONE]
    if all(same_rows(f, cond) for f in rest):
      return [cond.moved(0)]
  return None


_TRANSFER = {
    **dict.fromkeys(_IDENTITY, _identity),
    "IdentityN": _identity_n,
    **dict.fromkeys(["OnesLike", "ZerosLike"], _like),
    "Fill": _fill,
    "Tile": _tile,
    **dict.fromkeys(["Sum", "Mean", "Max", "Min", "Any", "All", "ArgMax",
                     "ArgMin"], _reduction),
    **dict.fromkeys(["Merge", "RefMerge"], _merge),
    **dict.fromkeys(["MatMul", "BatchMatMul", "BatchMatMulV2",
                     "BatchMatMulV3"], _matmul),
    **dict.fromkeys(["TopKV2", "TopK", "Roll", "ReverseV2", "Cumsum",
                     "Cumprod", "CumulativeLogsumexp", "ReverseSequence"],
                    _along),
    "OneHot": _one_hot,
    **dict.fromkeys(["BlockLSTM", "BlockLSTMV2"], _time_major),
    "Select": _select,
}
_TABLES = (shape_layout.TRANSFER, reshape_layout.TRANSFER,
           slice_layout.TRANSFER, index_layout.TRANSFER,
           sparse_layout.TRANSFER, loop_layout.TRANSFER, _TRANSFER)


def transfer(op, inputs):
  """The facts of `op`'s outputs, or None where no table models it (or
  the model cannot read this op: `tf.gather` of a shape by unknown
  positions is then a gather of values)."""
  for table in _TABLES:
    function = table.get(op.type)
    facts = None if function is None else function(op, inputs)
    if facts is not None:
      return facts
  return None
