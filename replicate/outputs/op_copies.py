"""Tower 0's ops built again on other inputs (the whole batch's), once each.

On what is copied: an op of the same type and attributes, on its device,
reading the new inputs; its shapes are inferred again from them (a batch of
known size gives the whole batch's). Its colocation with tower 0's ops is
dropped. The ops before it are copied first, without recursion (real
models are deep).

On what is not (`CannotBuild`): a TF 1 loop's frame (`Enter` ... `Exit`,
which cannot be built again op by op) and placeholders; a stateful op (it
may write state, which must not change twice), except a `py_func` (a
function of its inputs, called again on every row) and ops that only check
or print, also inside a function a TF 2 cond or a `tf.function` calls; an op whose shape
inference refuses the new inputs (a shape made for the tower's rows when
built: `tf.reshape(x, [4, -1])` from `x.shape`); more ops than `budget`.
"""

import tensorflow as tf

from replicate import _tf
from replicate.graph import op_types

# Stateful ops that are still a function of their inputs.
_CALLED_AGAIN = op_types.PY_FUNC_TYPES
# Stateful ops that change nothing: checks and prints.
_CHECKS = frozenset(["Assert", "PrintV2", "Print"])
# A TF 1 cond's Switch and Merge are built again (`tf.nn.zero_fraction`'s
# cond of the size, under TF 1 behaviour), a TF 1 loop is not: its frame.
_NO_COPY = op_types.TF1_LOOP_TYPES | {"Placeholder",
                                      "PlaceholderWithDefault"}


class CannotBuild(Exception):
  """Why a value's whole batch's cannot be built: `str()` is a clause
  ("the op 'x' is ...") for the caller's message."""


class OpCopies:
  """Copies of ops of `graph`.

  `given(tensor)`: the new value of an input, or None if its op is to be
  copied too; `copies_control(op)`: whether a control input is copied
  (else the copy waits on the op itself).
  """

  def __init__(self, graph, given, copies_control):
    self._graph = graph
    self._given = given
    self._copies_control = copies_control
    self._copies = {}  # op -> its copy
    self.budget = None  # copies that may still be made (None: no limit)

  def copy(self, op) -> tf.Operation:
    """`op` again, on its inputs' new values: the ops before it first."""
    stack, expanded = [(op, False)], set()
    while stack:
      current, ready = stack.pop()
      if current in self._copies:
        continue
      if ready:
        self._copy_one(current)
        continue
      if current in expanded:
        continue
      expanded.add(current)
      _check(current)
      stack.append((current, True))
      stack.extend((tensor.op, False) for tensor in current.inputs
                   if self._given(tensor) is None)
      stack.extend((control, False) for control in current.control_inputs
                   if self._copies_control(control))
    return self._copies[op]

  def _value(self, tensor):
    given = self._given(tensor)
    if given is not None:
      return given
    return self._copies[tensor.op].outputs[tensor.value_index]

  def _copy_one(self, op):
    inputs = [self._value(t) for t in op.inputs]
    controls = [self._copies.get(c, c) for c in op.control_inputs]
    given = list(op.inputs) + list(op.control_inputs)
    if all(new is old for new, old in zip(inputs + controls, given)):
      self._copies[op] = op
      return
    if self.budget is not None:
      self.budget -= 1
      if self.budget < 0:
        raise CannotBuild("it needs more ops built again than a summary "
                          "is worth")
    attrs = {name: value for name, value in op.node_def.attr.items()
             if name != "_class"}  # not colocated with tower 0's ops
    try:
      with tf.device(op.device), tf.control_dependencies(controls):
        copy = self._graph.create_op(
            op.type, inputs, [t.dtype for t in op.outputs],
            name=op.name.split("/")[-1], attrs=attrs)
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as error:
      raise CannotBuild(
          "the op {!r} cannot be built for the whole batch's rows: "
          "{}".format(op.name, str(error).split("\n")[0]))
    self._copies[op] = copy


def _check(op):
  if op.type in _NO_COPY:
    raise CannotBuild(
        "the op {!r} is part of a TF 1 tf.while_loop, which cannot be "
        "built again op by op".format(op.name))
  if _tf.is_stateful(op) and op.type not in _CALLED_AGAIN and not (
      op.type in _CHECKS or _only_checks(op)):
    raise CannotBuild(
        "the op {!r} ({}) is stateful, and is not run twice".format(
            op.name, op.type))


def _only_checks(op) -> bool:
  """A function call whose stateful ops only check, print or call Python
  (a `tf.debugging.assert_*` or a `numpy_function` in a TF 2 cond or a
  `tf.function`): run again, it changes nothing."""
  called = _tf.called_functions(op)
  return called is not None and called <= _CHECKS | _CALLED_AGAIN
