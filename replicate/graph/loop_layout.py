"""How loops, conds and the lists loops fill move the rows: a TF 2
`tf.while_loop` (`dynamic_rnn`'s time loop, a CRF's decode), a TF 2
`tf.cond` and its TensorLists (a `TensorArray`'s).

On loops: a `While` op's outputs are its loop variables after the last
step. Their facts are found by running the row analysis over the loop's
body (its `FuncGraph`) from the variables' facts, joining what the body
returns with what it was given, until they agree (a state that starts
without rows, `zero_state`'s zeros of a known size, and comes back with
the rows along axis 0, has them there). Variables that disagree along
different axes are UNKNOWN. A body this process did not build (a loaded
graph) leaves every output UNKNOWN.

On conds: an `If`'s outputs are its branches' outputs, each found by the
row analysis over the branch from the arguments' facts, the two joined as
a loop's variables are (tfa's `crf_decode` returns its tags from a cond on
the sequences' length).

On lists: a TensorList is a variant scalar; its fact is its elements'
(`TensorListFromTensor` of `[time, rows, d]` has elements with the rows
along axis 0, `TensorListStack` puts them back along axis 1). A list of
the rows themselves (`tf.map_fn` over `[rows, d]`) is ALIGNED along axis
-1: an element read from it at index i is row i's (a NONE fact with
`row_of` i), and so is every value computed from it and from values
without rows (`each_row`); written back at the same index i, it makes
its list one of the rows again, which stacks to the rows along axis 0.
Such a value that a loop carries to its next step, written at another
index, or meeting other rows, is UNKNOWN (a `tf.scan` down the batch).

A TF 1 `TensorArray` (`TensorArrayV3`: a handle and a float "flow" that
each write returns and each read takes) keeps the same fact on its flow:
what `TensorArrayScatterV3` and `TensorArrayWriteV3` put in,
`TensorArrayReadV3` and `TensorArrayGatherV3` take out (a TF 1 loop's,
see `frame_layout`).
"""

from replicate import _tf
from replicate.graph.row_facts import (
    ALIGNED, NONE, NO_ROWS, UNKNOWN_ROWS, Fact, static)

LOOPS = frozenset(["While", "StatelessWhile"])
CONDS = frozenset(["If", "StatelessIf"])
ROUNDS = 4  # each round can only move a fact towards UNKNOWN


def calls_facts(analysis, op, inputs):
  """The facts of a value of the rows a list holds one by one (`each_row`),
  of a TF 2 loop's or cond's outputs; None for other ops, or where not
  known. `analysis(func_graph, input_facts)` -> a layout of a body."""
  facts = each_row(op, inputs)
  if facts:
    return facts
  if op.type in LOOPS:
    return loop_facts(analysis, op, inputs)
  if op.type in CONDS:
    return cond_facts(analysis, op, inputs)
  return None


def loop_facts(analysis, op, inputs):
  """The facts of a `While` op's outputs, or None if its body is not
  known. `analysis(func_graph, input_facts)` -> a layout of the body."""
  body = body_of(op)
  if body is None:
    return None
  facts = list(inputs)
  for _ in range(ROUNDS):
    layout = analysis(body, facts)
    joined = [join(given, layout.fact(out))
              for given, out in zip(facts, body.outputs)]
    if joined == facts:
      return facts[:len(op.outputs)]
    facts = joined
  return [f if f.kind == NONE else UNKNOWN_ROWS for f in facts][
      :len(op.outputs)]


def cond_facts(analysis, op, inputs):
  """The facts of a TF 2 cond's (`If`'s) outputs: each branch's output
  from its arguments' facts (`op.inputs[1:]`; the first is the
  predicate), the two joined; None if a branch is not known."""
  found = None
  for attr in ("then_branch", "else_branch"):
    branch = _tf.function_graph(op, attr)
    if branch is None or len(branch.inputs) != len(inputs) - 1 or len(
        branch.outputs) != len(op.outputs):
      return None
    layout = analysis(branch, inputs[1:])
    facts = [layout.fact(out) for out in branch.outputs]
    found = facts if found is None else [
        join(first, second) for first, second in zip(found, facts)]
  return found


def body_of(op):
  """A `While` op's body (a `FuncGraph`), or None where this process did
  not build it or its arguments are not the loop's variables."""
  body = _tf.function_graph(op, "body")
  if body is None or len(body.inputs) != len(op.inputs) or len(
      body.outputs) != len(op.inputs):
    return None
  return body


def join(first: Fact, second: Fact) -> Fact:
  """One fact for a value that may be either (a loop variable before and
  after a step): a value without rows that comes back with them has them;
  one row's, carried to the next step (the next row's), is UNKNOWN."""
  if first.row_of is not None or second.row_of is not None:
    return UNKNOWN_ROWS
  if first == second:
    return first
  if first.kind == NONE and second.kind == NONE:
    return NO_ROWS  # numbers that change from step to step
  if first.kind == NONE or second.kind == NONE:
    fact = second if first.kind == NONE else first
    return fact.moved(fact.axis) if fact.carries else fact
  if first.kind == second.kind and first.axis == second.axis:
    return first.moved(first.axis)._replace(
        block=first.block if first.block == second.block else None)
  return UNKNOWN_ROWS


def each_row(op, inputs):
  """The facts of an op on one row's values (`row_of`) and on values
  without rows: that row's; None where no input is one row's."""
  rows = {f.row_of for f in inputs if f.row_of is not None}
  if not rows or op.type in TRANSFER:
    return None
  if len(rows) > 1 or any(f.kind != NONE for f in inputs):
    return [UNKNOWN_ROWS] * len(op.outputs)  # other rows meet it
  return [Fact(row_of=rows.pop())] * len(op.outputs)


def _element(fact, shift):
  """The fact moved by `shift` axes (a list's elements and the stacked
  tensor differ by the leading list axis; -1: the list's are the rows)."""
  if fact.row_of is not None:
    return UNKNOWN_ROWS  # one row's values as a list's (or a tensor's)
  if not fact.carries:
    return fact if fact.kind == NONE else UNKNOWN_ROWS
  axis = fact.axis + shift
  if axis < -1 or axis == -1 and fact.kind != ALIGNED:
    return UNKNOWN_ROWS  # rows across the list's elements, not in order
  return fact.moved(axis)


def _read(fact, index):
  """An element read at `index` (a tensor): of a list of the rows, the
  row at `index`'s."""
  if fact.carries and fact.axis == -1:
    return Fact(row_of=index.ref())
  return _element(fact, 0)


def _written(flow, value, index):
  """A list after `value` is written at `index`: one row's written at its
  own index keeps (or makes) a list of the rows."""
  if value.row_of is not None:
    value = (Fact(ALIGNED, -1) if value.row_of == index.ref() else
             UNKNOWN_ROWS)
  return join(flow, value)


def _gathered(fact, indices, shift=1):
  """Elements taken (or a tensor's rows scattered, `shift` -1) by
  `indices`: between the rows and a list of them, only all of them in
  order (`tf.range(size)`) keeps the rows in order."""
  fact = _element(fact, shift)
  if fact.carries and -1 in (fact.axis, fact.axis - shift) and not (
      indices.op.type == "Range" and static(indices.op.inputs[0]) == [0] and
      static(indices.op.inputs[2]) == [1]):
    return UNKNOWN_ROWS
  return fact


def _from_tensor(op, inputs):
  if op.type != "TensorListFromTensor":
    return [_gathered(inputs[0], op.inputs[1], -1)]
  return [_element(inputs[0], -1)]


def _stack(op, inputs):
  if op.type == "TensorListGather":
    return [_gathered(inputs[0], op.inputs[1])]
  return [_element(inputs[0], 1)]


def _get_item(op, inputs):
  return [_read(inputs[0], op.inputs[1])]


def _set_item(op, inputs):
  if op.type == "TensorListSetItem":
    return [_written(inputs[0], inputs[2], op.inputs[1])]
  return [join(inputs[0], inputs[1])]


def _empty(op, inputs):
  return [NO_ROWS] * len(op.outputs)


# A TF 1 TensorArray's ops: (handle, ..., flow_in); its flow is the list.
def _array_scatter(op, inputs):  # (handle, indices, value, flow_in)
  return [join(inputs[3], _gathered(inputs[2], op.inputs[1], -1))]


def _array_write(op, inputs):  # (handle, index, value, flow_in)
  return [_written(inputs[3], inputs[2], op.inputs[1])]


def _array_read(op, inputs):  # (handle, index, flow_in)
  return [_read(inputs[-1], op.inputs[1])]


def _array_gather(op, inputs):  # (handle, indices, flow_in)
  return [_gathered(inputs[-1], op.inputs[1])]


def _array_concat(op, inputs):
  """(handle, flow_in) -> (value, lengths): the elements end to end along
  their axis 0, where rows would no longer be in one block."""
  fact = inputs[-1]
  if fact.carries and fact.axis in (-1, 0):
    return [UNKNOWN_ROWS, NO_ROWS]
  return [_element(fact, 0), NO_ROWS]


def _array_split(op, inputs):  # (handle, value, lengths, flow_in)
  fact = inputs[1]
  if fact.carries and fact.axis == 0:
    return [UNKNOWN_ROWS]
  return [join(inputs[3], _element(fact, 0))]


def _array_grad(op, inputs):  # (handle, flow_in): the gradients' array
  return [NO_ROWS, inputs[1]]


TRANSFER = {
    **dict.fromkeys(["TensorListFromTensor", "TensorListScatter",
                     "TensorListScatterV2"], _from_tensor),
    **dict.fromkeys(["TensorListStack", "TensorListGather"], _stack),
    "TensorListGetItem": _get_item,
    **dict.fromkeys(["TensorListSetItem", "TensorListPushBack"], _set_item),
    **dict.fromkeys(["TensorListReserve", "EmptyTensorList",
                     "TensorListLength", "TensorListElementShape",
                     "TensorArrayV3", "TensorArraySizeV3"], _empty),
    "TensorArrayScatterV3": _array_scatter,
    "TensorArrayWriteV3": _array_write,
    "TensorArrayReadV3": _array_read,
    "TensorArrayGatherV3": _array_gather,
    "TensorArrayConcatV3": _array_concat,
    "TensorArraySplitV3": _array_split,
    "TensorArrayGradV3": _array_grad,
}
