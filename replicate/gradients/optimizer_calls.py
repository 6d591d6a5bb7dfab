"""Each tower's optimizer calls: recorded, matched to tower 0's, summed.

On records: `OptimizerRecords.record` keeps an `OptimizerCall` per call,
in each tower's order; `replicate.state.train_op` checks every tower made
as many.

On matching: every tower's `model_fn` makes the same optimizer calls in the
same order, so tower i's call at position k goes with tower 0's call k. It
must be the same kind of optimizer, with gradients for the same variables
(a replicated tower's copies standing for tower 0's variables); anything
else is an error, never a silent sum of unrelated gradients.

On sums: once the last tower has made its call k, the towers' gradients are
combined by the variable strategy (summed or all-reduced) in tower 0's
device and name scope, and connected to the stand-ins tower 0's update was
built on (see `replicate.gradients.stand_ins`). A stand-in no sum comes back for gets
zeros; a gradient that another tower has and tower 0 lacks is refused.
"""

import contextlib
from typing import Any, List, NamedTuple, Optional

import tensorflow as tf

from replicate.gradients import stand_ins
from replicate.gradients import touched


class OptimizerCall(NamedTuple):
  """One `TowerOptimizer.apply_gradients` call made by one tower."""
  optimizer: Any
  grads_and_vars: List[Any]
  name_scope: str  # the name scope the call was made in
  result: Any  # what the call returned: tower 0's update, in every tower
  # Tower 0 only: the (stand-in gradient, variable) pairs its update was
  # built on, connected to the sums by the last tower (see `stand_ins`).
  stand_in_pairs: Optional[List[Any]] = None
  # Per pair, whether the gradient is already the whole batch's (computed
  # from `GradientCall` stand-ins): applied as it is, never summed again.
  whole: tuple = ()
  # The gradients from tf.gradients or a GradientTape that the user's code
  # read before this call, made the whole batch's (see `touched`).
  touched: tuple = ()


class GradientCall(NamedTuple):
  """One `compute_gradients` call of one tower: its gradients, and the
  stand-ins for their sums over towers that the `model_fn` got instead."""
  own: List[Any]  # (the tower's weighted gradient, variable) pairs
  whole: List[Any]  # (stand-in for the sum, variable) pairs, returned
  name_scope: str


class OptimizerRecords:
  """Every tower's `TowerOptimizer.apply_gradients` calls, in order."""

  def __init__(self, graph, num_towers: int):
    self._graph = graph
    self.calls: List[List[OptimizerCall]] = [[] for _ in range(num_towers)]
    self.gradient_calls: List[List[GradientCall]] = [
        [] for _ in range(num_towers)]
    self._whole = [[] for _ in range(num_towers)]  # stand-ins, per tower

  def record(self, index: int, optimizer, grads_and_vars, result,
             stand_in_pairs=None, whole=(), touched=()) -> int:
    """Records tower `index`'s call; returns its position in the tower."""
    calls = self.calls[index]
    calls.append(OptimizerCall(optimizer, list(grads_and_vars),
                               self._graph.get_name_scope(), result,
                               stand_in_pairs,
                               tuple(whole), tuple(touched)))
    return len(calls) - 1

  def add_whole(self, index: int, whole_stand_ins) -> None:
    """`whole_stand_ins` (tower `index`'s) will read sums over towers."""
    self._whole[index].extend(g for g in whole_stand_ins if g is not None)

  def record_gradients(self, index: int, own, whole) -> int:
    """Records tower `index`'s `compute_gradients`; returns its position."""
    calls = self.gradient_calls[index]
    calls.append(GradientCall(list(own), list(whole),
                              self._graph.get_name_scope()))
    self.add_whole(index, [grad for grad, _ in whole])
    return len(calls) - 1

  def whole_ops(self, index: int) -> List[tf.Operation]:
    """The ops of tower `index`'s stand-ins for whole-batch gradients."""
    return [op for grad in self._whole[index] for op in _ops_of(grad)]

  def counts(self) -> List[int]:
    """How many `apply_gradients` calls each tower made.

    Read once every tower is built, so it also fails closed on towers that
    made different numbers of `compute_gradients` calls (a stand-in for a
    sum no tower connected would pass one tower's gradients on).
    """
    gradient_counts = [len(calls) for calls in self.gradient_calls]
    if len(set(gradient_counts)) > 1:
      raise ValueError(
          "The towers made different numbers of TowerOptimizer."
          "compute_gradients calls ({}): each tower's model_fn was supposed "
          "to make the same optimizer calls in the same order. Make the "
          "calls independent of the tower's data.".format(", ".join(
              "tower {}: {}".format(i, n)
              for i, n in enumerate(gradient_counts))))
    return [len(calls) for calls in self.calls]


def tower0_call(context, position):
  """Tower 0's call at `position`, which tower i's call must match."""
  first = context.records.calls[0]
  if len(first) <= position:
    raise ValueError(
        "Tower {} made {} TowerOptimizer.apply_gradients calls, more than "
        "tower 0's {}: each tower's model_fn was supposed to make the same "
        "optimizer calls in the same order. Make the calls independent of "
        "the tower's data.".format(context.progress.tower_index,
                                   position + 1,
                                   len(first)))
  return first[position]


def connect_whole_batch(context, position):
  """Sums `compute_gradients` call `position` over towers; every tower's
  stand-ins read the sum (with replicated variables, on its own device)."""
  calls = context.records.gradient_calls
  reference = calls[0][position]
  for index, tower in enumerate(calls):
    if (len(tower) <= position or not _same_variables(
        tower[position].own, reference.own, context)):
      raise ValueError(
          "Tower {}'s TowerOptimizer.compute_gradients call {} differs from "
          "tower 0's (missing, or gradients for other variables): each "
          "tower's model_fn was supposed to make the same optimizer calls in "
          "the same order. Make the calls independent of the tower's "
          "data.".format(index, position + 1))
  with _scopes_of(reference, context.layout, context.progress):
    summed = context.layout.strategy.combine(
        [tower[position].own for tower in calls], context.weights.counts(),
        context.layout.devices)
    by_variable = {variable.ref(): grad for grad, variable in summed}
    for tower in calls:
      for stand_in, variable in tower[position].whole:
        _connect(stand_in, variable, by_variable.get(variable.ref()))


def connect_sums(context, position):
  """Sums call `position`'s gradients over towers; feeds tower 0's update.

  A gradient that is already the whole batch's (see `OptimizerCall.whole`)
  is not summed again: tower 0's update applies its own, and a replicated
  tower's copy the value that tower computed, on its device.
  """
  per_tower = _same_call_in_every_tower(context, position)
  tower0_call = context.records.calls[0][position]
  whole = tower0_call.whole or (False,) * len(per_tower[0])
  own_values = {}  # variable (or copy) ref -> a whole-batch gradient
  for tower in per_tower:
    for is_whole, (grad, variable) in zip(whole, tower):
      if is_whole:
        own_values.setdefault(variable.ref(), grad)
  per_tower = [[(None if is_whole else grad, variable)
                for is_whole, (grad, variable) in zip(whole, tower)]
               for tower in per_tower]
  touched.connect(context, [calls[position].touched
                            for calls in context.records.calls],
                  _scopes_of(tower0_call, context.layout, context.progress))
  with _scopes_of(tower0_call, context.layout, context.progress):
    # Whether each tower counts: it has rows and its loss denominator, if
    # stated, is not 0 (else its gradients may be NaN: see `weighting`).
    summed = context.layout.strategy.combine(
        per_tower, context.weights.counts(), context.layout.devices)
    by_variable = {variable.ref(): grad for grad, variable in summed}
    by_variable.update({ref: grad for ref, grad in own_values.items()
                        if grad is not None})
    for stand_in, variable in tower0_call.stand_in_pairs:
      _connect(stand_in, variable, by_variable.get(variable.ref()))


def _connect(stand_in, variable, total):
  if stand_in is None:
    if total is not None:
      raise ValueError(
          "Tower 0 has no gradient for {!r}, but another tower has one: "
          "each tower's loss must depend on the same variables. Make the "
          "model_fn build the same model whatever its data.".format(
              variable.op.name))
    return
  stand_ins.connect(stand_in, total if total is not None else tf.zeros_like(
      stand_in if not isinstance(stand_in, tf.IndexedSlices) else
      stand_in.values))


def _ops_of(grad):
  if isinstance(grad, tf.IndexedSlices):
    return [grad.values.op, grad.indices.op]
  return [grad.op]


@contextlib.contextmanager
def _scopes_of(call, layout, progress):
  """Tower 0's device and the name scope of its `call`, for the sums.

  The sums are built in the last tower, once every tower's gradients
  exist, but feed tower 0's update; they are replicate's own ops.
  """
  name_scope = call.name_scope + "/" if call.name_scope else ""
  with layout.graph.device(layout.towers[0].device_function), \
      layout.graph.name_scope(name_scope), progress.building_own_ops():
    yield


def _same_call_in_every_tower(context, position):
  """Every tower's gradients for call `position`, checked to be alike."""
  reference = context.records.calls[0][position]
  per_tower = []
  for index, calls in enumerate(context.records.calls):
    call = calls[position] if position < len(calls) else None
    # Each tower usually builds its own optimizer object; what must match is
    # the kind of optimizer and the variables it updates.
    if (call is None or type(call.optimizer.optimizer) is not type(
        reference.optimizer.optimizer) or not _same_variables(
            call.grads_and_vars, reference.grads_and_vars, context)):
      raise ValueError(
          "Tower {}'s optimizer call {} differs from tower 0's (another kind "
          "of optimizer, or gradients for other variables): each tower's "
          "model_fn was supposed to make the same optimizer calls in the same "
          "order.".format(index, position + 1))
    per_tower.append(call.grads_and_vars)
  return per_tower


def _same_variables(grads_and_vars, tower0_grads_and_vars, context):
  # By identity: `==` on variables builds an elementwise comparison op. A
  # replicated tower's copies stand for tower 0's variables.
  tower0_variable = context.variables.tower0_variable
  return len(grads_and_vars) == len(tower0_grads_and_vars) and all(
      tower0_variable(a) is b
      for (_, a), (_, b) in zip(grads_and_vars, tower0_grads_and_vars))
