"""How a TF 1 loop moves the rows: `tf.while_loop` under v1 control flow
(`tf.compat.v1.disable_control_flow_v2()`, TF 1 behaviour), as
`dynamic_rnn`, `tf.scan`, `tf.map_fn` build it: a frame of Enter, Merge,
Switch, NextIteration, Exit and LoopCond ops in the graph itself, not a
function (`replicate.graph.loop_layout` reads a TF 2 `While`'s body).

On a frame: each loop variable is a `Merge` of its `Enter` (the value
before the first step) and its `NextIteration` (the value a step gives
back), switched by the frame's one `LoopCond` to the body (`Identity`) or
out (`Exit`). A value the body reads unchanged enters through an `Enter`
of its own (`is_constant`). Enter, Switch, Identity, NextIteration and
Exit pass a value on unchanged.

On the fixpoint: the Merges' facts are those of their Enters; the body is
followed from them (a scratch layout that keeps what it finds apart) up to
each NextIteration; each Merge's fact becomes the join of what it had and
what comes back (`loop_layout.join`), and again, until none changes (a
state that starts as zeros of a known size and comes back with the rows
along axis 0 has them there), at most `loop_layout.ROUNDS` times, then
UNKNOWN for each that still changes. The same decision a TF 2 `While` of
the same loop gets. A frame that is not as `tf.while_loop` builds it (no
one `LoopCond`) leaves its variables UNKNOWN.

On cost: the frame's entries (every Enter of the frame the body reads) are
found by one walk back over the body and computed first, in the layout
that found the loop; each round then follows the body only, so the work is
the body's size times the rounds (a loop inside a loop: times theirs).
"""

from typing import NamedTuple, Optional, Tuple

import tensorflow as tf

NEXT_ITERATION = frozenset(["NextIteration", "RefNextIteration"])
_ENTER = frozenset(["Enter", "RefEnter"])
_MERGE = frozenset(["Merge", "RefMerge"])
_SWITCH = frozenset(["Switch", "RefSwitch"])


class Frame(NamedTuple):
  """One TF 1 loop: its variables' Merges and what enters it."""
  name: bytes
  merges: Tuple[tf.Operation, ...]
  entries: Tuple[tf.Tensor, ...]  # the Enters' outputs the loop reads


def is_loop_merge(op: tf.Operation) -> bool:
  """A loop variable's Merge (one of its inputs comes round the loop), not
  a TF 1 `tf.cond`'s."""
  return op.type in _MERGE and any(t.op.type in NEXT_ITERATION
                                   for t in op.inputs)


def frame_of(merge: tf.Operation) -> Optional[Frame]:
  """The loop `merge` is a variable of, or None where its ops are not as
  `tf.while_loop` builds them."""
  name = _frame_name(merge)
  conds = {switch.inputs[1].op for switch in merge.outputs[0].consumers()
           if switch.type in _SWITCH and len(switch.inputs) == 2}
  if name is None or len(conds) != 1 or conds.copy().pop().type != (
      "LoopCond"):
    return None
  cond, merges = conds.pop(), []
  for switch in cond.outputs[0].consumers():
    source = switch.inputs[0].op if switch.type in _SWITCH else None
    if (source is not None and is_loop_merge(source) and
        source not in merges and _frame_name(source) == name):
      merges.append(source)
  if merge not in merges:
    return None
  return Frame(name, tuple(merges), _entries(name, merges, cond))


def back_edge(merge: tf.Operation) -> tf.Tensor:
  """The value a step gives back to `merge` (its NextIteration's input)."""
  return [t.op for t in merge.inputs if t.op.type in NEXT_ITERATION][
      0].inputs[0]


def enter_of(merge: tf.Operation) -> Optional[tf.Tensor]:
  """The value `merge` takes at the first step (its Enter's output)."""
  enters = [t for t in merge.inputs if t.op.type in _ENTER]
  return enters[0] if len(enters) == 1 else None


def _frame_name(merge):
  enter = enter_of(merge)
  return None if enter is None else enter.op.get_attr("frame_name")


def _entries(name, merges, cond):
  """Every Enter of frame `name` the loop reads: its variables' first
  values, and those the body and the condition read, found by walking back
  from the NextIterations and the LoopCond to the Merges and the Enters (a
  loop inside the loop is walked through, its own Enters included)."""
  entries = [enter_of(merge) for merge in merges]
  stop = set(merges)
  pending = [back_edge(merge).op for merge in merges] + [cond]
  seen = set(pending)
  while pending:
    op = pending.pop()
    for tensor in op.inputs:
      source = tensor.op
      if source in stop or source in seen:
        continue
      seen.add(source)
      if source.type in _ENTER and source.get_attr("frame_name") == name:
        entries.append(tensor)
      else:
        pending.append(source)
  return tuple(dict.fromkeys(entries))
