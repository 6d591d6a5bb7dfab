"""The one rule for "computed from the tower's rows", in every mode.

On the rule: a value a tower built depends on its rows when it is, or
walking back its data inputs within the ops the tower built reaches,
- a tensor of the tower's shard of `features` or `labels`; or
- a constant TensorFlow folded from a shape known when the graph was built.
  With a batch of known size `tf.size(x)`, `tf.shape(x)`, `tf.ones_like(x)`
  and `tf.zeros_like(x)` become constants, which keep the names TensorFlow
  gives those ops (`Size`, `Shape`, `ones_like`, `zeros_like`); a count taken
  from the static `x.shape[0]` is a plain Python number and does not count.

A value that is the whole batch's (an op marked `WHOLE_BATCH`: the sums
over towers of the gradients `TowerOptimizer.compute_gradients` returns,
see `replicate.gradients.stand_ins`) is the same in every tower, not the
tower's rows: the walk does not go past it.

Function calls (`tf.function`, TF 2 `tf.cond` and `tf.while_loop`) depend on
the rows when their inputs do, so the walk goes through them as through any
op. Reads of variables are not followed back to the writes that came before
them: what a shared variable holds is the state every tower sees (see
`replicate.state.train_op`, which makes a tower's reads after a combined write
wait for every tower's write), not a tower's rows.

`outputs.predictions` (what is put back together along the batch), `state`
(which state changes are made per tower) and `gradients.weighting` (which
gradients still need the tower's weight) all ask this module; none keeps
its own rule.
"""

import re
from typing import Any, Callable, Container, Iterable, Optional

import tensorflow as tf

# What TensorFlow names a constant it folded from a tensor's shape known
# when the graph is built (`tf.size`, `tf.shape`, `tf.ones_like`,
# `tf.zeros_like`), possibly uniquified (`Shape_1`).
# The Python attribute marking an op whose value is the whole batch's.
WHOLE_BATCH = "replicate_whole_batch"

_FOLDED_SHAPE = re.compile(r"(Size|Shape|ones_like|zeros_like)(_[0-9]+)?")


class TowerRows:
  """Answers whether values one tower built are computed from its rows.

  Args:
    shard: the tower's shard (`features` and `labels`, any structure).
    tower_ops: the ops the tower built; the walk stays within them. None:
      the whole graph (for a tower still being built).
    inputs_of: which inputs of an op the walk follows (default: all).
  """

  def __init__(self, shard: Any, tower_ops: Optional[Container] = None,
               inputs_of: Optional[Callable] = None,
               count_folded: bool = True):
    self._shard = {t.ref() for t in tf.nest.flatten(shard,
                                                   expand_composites=True)
                   if isinstance(t, tf.Tensor)}
    self._tower_ops = tower_ops
    # False: a folded constant is not taken for the rows (the loss rule's
    # second look at a term it cannot read).
    self._count_folded = count_folded
    self._answers = {}  # op -> whether it depends on the rows
    self._inputs_of = inputs_of or (lambda op: op.inputs)

  def static_count(self) -> Optional[int]:
    """The shard's number of rows where every dense leaf knows it, else None."""
    counts = {tf.compat.dimension_value(ref.deref().shape[0])
              for ref in self._shard if ref.deref().shape.rank}
    return counts.pop() if len(counts) == 1 else None

  def depend(self, values: Iterable[Any]) -> bool:
    """Whether any of `values` (tensors, slices, ops) depends on the rows."""
    return any(self._op_depends(op) for op in _ops_of(values))

  def _op_depends(self, start: tf.Operation) -> bool:
    """Walks back from `start` once; remembers the answer for every op."""
    if start in self._answers:
      return self._answers[start]
    if getattr(start, WHOLE_BATCH, False):
      self._answers[start] = False
      return False
    # The value may be the rows themselves: a feature passed through
    # (`predictions=features`), or `tf.zeros_like(x)` folded to one constant.
    if (any(t.ref() in self._shard for t in start.outputs) or
        self._is_folded_shape(start)):
      self._answers[start] = True
      return True
    # Iterative depth-first walk: graphs of real models are deep.
    stack = [(start, iter(self._inputs_of(start)))]
    visiting = {start}
    result = {}
    found = False
    while stack and not found:
      op, inputs = stack[-1]
      tensor = next(inputs, None)
      if tensor is None:
        stack.pop()
        result[op] = False
        continue
      if tensor.ref() in self._shard or self._is_folded_shape(tensor.op):
        found = True
        break
      source = tensor.op
      if source in visiting or source in result:
        if self._answers.get(source):
          found = True
        continue
      if source in self._answers:
        if self._answers[source]:
          found = True
        continue
      if ((self._tower_ops is not None and source not in self._tower_ops) or
          getattr(source, WHOLE_BATCH, False)):
        result[source] = False
        continue
      visiting.add(source)
      stack.append((source, iter(self._inputs_of(source))))
    if found:
      # Every op on the path to the rows depends on them.
      for op, _ in stack:
        self._answers[op] = True
      self._answers[start] = True
      return True
    self._answers.update(result)
    self._answers[start] = False
    return False

  def _is_folded_shape(self, op: tf.Operation) -> bool:
    return (self._count_folded and
            (self._tower_ops is None or op in self._tower_ops) and
            folded_shape_kind(op) is not None)


def folded_shape_kind(op: tf.Operation) -> Optional[str]:
  """"Size", "Shape", "ones_like" or "zeros_like": what TensorFlow folded
  to the constant `op` from a shape known when the graph was built; None
  for any other op."""
  if op.type != "Const":
    return None
  match = _FOLDED_SHAPE.fullmatch(op.name.split("/")[-1])
  return match.group(1) if match else None


def _ops_of(values):
  for value in values:
    if value is None:
      continue
    if isinstance(value, tf.Operation):
      yield value
    elif isinstance(value, tf.IndexedSlices):
      yield value.values.op
      yield value.indices.op
    elif isinstance(value, tf.Variable):
      continue  # a variable itself is state, not rows
    else:
      yield tf.convert_to_tensor(value).op
