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
along axis 0, `TensorListStack` puts them back along axis 1).
"""

from replicate import _tf
from replicate.graph.row_facts import NONE, NO_ROWS, UNKNOWN_ROWS, Fact

LOOPS = frozenset(["While", "StatelessWhile"])
CONDS = frozenset(["If", "StatelessIf"])
_ROUNDS = 4  # each round can only move a fact towards UNKNOWN


def loop_facts(analysis, op, inputs):
  """The facts of a `While` op's outputs, or None if its body is not
  known. `analysis(func_graph, input_facts)` -> a layout of the body."""
  body = _tf.function_graph(op, "body")
  if body is None or len(body.inputs) != len(inputs) or len(
      body.outputs) != len(inputs):
    return None
  facts = list(inputs)
  for _ in range(_ROUNDS):
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


def join(first: Fact, second: Fact) -> Fact:
  """One fact for a value that may be either (a loop variable before and
  after a step): a value without rows that comes back with them has them."""
  if first == second:
    return first
  if first.kind == NONE and second.kind == NONE:
    return NO_ROWS  # numbers that change from step to step
  if first.kind == NONE or second.kind == NONE:
    fact = second if first.kind == NONE else first
    return fact.moved(fact.axis) if fact.carries else fact
  if first.kind == second.kind and first.axis == second.axis:
    return first.moved(first.axis)
  return UNKNOWN_ROWS


def _element(fact, shift):
  """The fact moved by `shift` axes (a list's elements and the stacked
  tensor differ by the leading list axis)."""
  if not fact.carries:
    return fact if fact.kind == NONE else UNKNOWN_ROWS
  axis = fact.axis + shift
  if axis < 0:
    return UNKNOWN_ROWS  # rows across the list's elements
  return fact.moved(axis)


def _from_tensor(op, inputs):
  return [_element(inputs[0], -1)]


def _stack(op, inputs):
  return [_element(inputs[0], 1)]


def _get_item(op, inputs):
  return [_element(inputs[0], 0)]


def _set_item(op, inputs):
  return [join(inputs[0], inputs[2] if op.type == "TensorListSetItem"
               else inputs[1])]


def _empty(op, inputs):
  return [NO_ROWS] * len(op.outputs)


TRANSFER = {
    **dict.fromkeys(["TensorListFromTensor", "TensorListScatter",
                     "TensorListScatterV2"], _from_tensor),
    **dict.fromkeys(["TensorListStack", "TensorListGather"], _stack),
    "TensorListGetItem": _get_item,
    **dict.fromkeys(["TensorListSetItem", "TensorListPushBack"], _set_item),
    **dict.fromkeys(["TensorListReserve", "EmptyTensorList",
                     "TensorListLength", "TensorListElementShape"], _empty),
}
