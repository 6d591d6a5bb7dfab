"""What each tower sees of the graph's loss, update and variable collections.

On `LOSSES`, `UPDATE_OPS` and `MOVING_AVERAGE_VARIABLES`: each tower sees
what it added itself (and what was there before the `model_fn` was
called), so that `tf.compat.v1.losses.get_total_loss()` in tower i sums
tower i's losses and `tf.control_dependencies(get_collection(UPDATE_OPS))`
waits for tower i's batch-norm updates only. `replicate.state.train_op`
combines the towers' updates.

On the variable collections: tower i sees tower 0's as tower 0 saw them at
the same point (`replicate.towers.variable_views`).

On `REGULARIZATION_LOSSES`: regularization belongs to the variables, not to
a shard, and must count once per step. With an averaging reduction each
tower's loss is weighted by its share of the batch, so the shares add up to
one regularization. Every tower sees tower 0's regularization losses, with
one exception: with `"replicated"` a layer regularises the tower's copy of a
variable again, and tower i sees those, its own, in place of tower 0's. A
tower's own gradient (`tf.gradients(loss, layer.weights)`, which reaches
only its copies) then holds the regularization's, as on one device; through
tower 0's variables it would miss it. The copies hold tower 0's values, so
the losses are equal. With `Reduction.SUM` the towers' losses are summed as
they are, so towers 1..N-1 see zeros in place of tower 0's regularization
losses, and tower 0's count once.

On the end: after the towers are built every collection holds what it held
before plus what tower 0 added, as the unwrapped `model_fn` leaves it.

This module is the only code that swaps a graph collection's list
(through `replicate._tf.replace_collection`).
"""

from typing import Callable, Dict, List

import tensorflow as tf

from replicate import _tf
from replicate.towers import variable_views

GraphKeys = tf.compat.v1.GraphKeys
LOSSES = GraphKeys.LOSSES
REGULARIZATION_LOSSES = GraphKeys.REGULARIZATION_LOSSES
UPDATE_OPS = GraphKeys.UPDATE_OPS
MOVING_AVERAGE_VARIABLES = GraphKeys.MOVING_AVERAGE_VARIABLES
_OWN_KEYS = (LOSSES, UPDATE_OPS, MOVING_AVERAGE_VARIABLES)
_KEYS = _OWN_KEYS + (REGULARIZATION_LOSSES,)


class TowerCollections:
  """Per-tower views of the graph's collections (see the docstring)."""

  def __init__(self, graph: tf.Graph, num_towers: int, sums_losses: bool,
               copies_variables: bool = False,
               update_bound: Callable[[int], int] = lambda index: 0):
    self._graph = graph
    # `update_bound`: see `variable_views.VariableViews`.
    self._variables = variable_views.VariableViews(graph, num_towers,
                                                   update_bound)
    self._sums_losses = sums_losses
    # Towers 1..N-1 see their copies' regularization (see the docstring).
    self._own_regularization = copies_variables and not sums_losses
    self._outer = {key: graph.get_collection(key) for key in _KEYS}
    # Per key, per tower: what the tower added to the collection.
    self._added: Dict[str, List[list]] = {
        key: [[] for _ in range(num_towers)] for key in _KEYS}

  def enter(self, index: int) -> None:
    """Shows tower `index` its view of each collection."""
    if index == 0:
      return
    for key in _OWN_KEYS:
      self._set(key, list(self._outer[key]))
    self._variables.enter(index, self._replace)
    if self._own_regularization:
      self._set(REGULARIZATION_LOSSES,
                list(self._outer[REGULARIZATION_LOSSES]))
      return
    tower0 = self._added[REGULARIZATION_LOSSES][0]
    if self._sums_losses:
      with tf.name_scope("regularization_counted_in_tower_0"):
        tower0 = [tf.zeros(loss.shape, loss.dtype) for loss in tower0]
    self._set(REGULARIZATION_LOSSES,
              _ClosedList(self._outer[REGULARIZATION_LOSSES] + tower0))

  def leave(self, index: int) -> None:
    """Records what tower `index` added."""
    for key in _KEYS:
      now = self._graph.get_collection(key)
      start = len(self._outer[key])
      if (index > 0 and key == REGULARIZATION_LOSSES and
          not self._own_regularization):
        start = len(now)  # towers 1..N-1 add none of their own
      self._added[key][index] = now[start:]
    self._variables.leave(index)
    own = self._added[REGULARIZATION_LOSSES]
    if (self._own_regularization and index > 0 and
        len(own[index]) != len(own[0])):
      raise ValueError(
          "Tower {} regularizes {} of its variables' copies, tower 0 {} "
          "variables (variable_strategy='replicated'): each tower's "
          "model_fn must create the same variables with the same "
          "regularizers, whatever its data.".format(
              index, len(own[index]), len(own[0])))

  def reach(self, index: int, variable) -> None:
    """Tower `index`'s variable creation resolved to tower 0's `variable`."""
    self._variables.reach(index, variable)

  def regularization(self) -> list:
    """The regularization losses tower 0 sees."""
    return (list(self._outer[REGULARIZATION_LOSSES]) +
            list(self._added[REGULARIZATION_LOSSES][0]))

  def finish(self) -> None:
    """Leaves each collection as the unwrapped model_fn would."""
    for key in _KEYS:
      self._set(key, self._outer[key] + self._added[key][0])
    self._variables.finish(self._replace)

  def update_ops(self, index: int) -> list:
    """What tower `index` added to `UPDATE_OPS`, in order."""
    return list(self._added[UPDATE_OPS][index])

  def _set(self, key, values):
    if not values and key not in self._graph.collections:
      return
    if not isinstance(values, _ClosedList):
      values = list(values)
    self._replace(key, values)

  def _replace(self, key, values):
    _tf.replace_collection(self._graph, key, values)


class _ClosedList(list):
  """A collection that ignores additions: towers 1..N-1's regularization."""

  def append(self, value):
    del value

  def extend(self, values):
    del values
