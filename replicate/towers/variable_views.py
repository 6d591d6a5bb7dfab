"""What towers 1..N-1 see of the variable collections: tower 0's, as it was.

On the views: a `model_fn` may pick variables from a collection
(`tf.compat.v1.global_variables()`, `trainable_variables()`, filtered by
name, as a moving average of the batch-norm statistics does). Tower 0
creates every variable; tower i reuses them, and must see in
`GLOBAL_VARIABLES`, `TRAINABLE_VARIABLES`, `TRAINABLE_RESOURCE_VARIABLES`
and `MODEL_VARIABLES` what tower 0 saw at the same point of the
`model_fn`. Seen whole, they would hold what tower 0 made later: its
`ExponentialMovingAverage`'s slots (`bn/moving_variance/Exponential...`,
whose names match a filter on `moving_variance`), and tower i would ask
for an average of an average.

On the point: tower 0's additions are ordered by the op that made them.
Tower i has reached tower 0's variable `v` when its own creation of `v`
resolved to it (`replicate.variables.matching`), and tower 0's k-th update
(the optimizer's slots) when it made its own k-th optimizer call. It sees
tower 0's additions up to the latest point it reached, worked out when the
collection is read (a `_TowerView` is the graph's list while the tower is
built), so a reader between two creations sees what tower 0 saw there.

On the end: the collections hold what tower 0 left (and anything a later
tower added of its own, which would otherwise go uninitialized).
"""

from typing import Callable, Dict, List

import tensorflow as tf

GraphKeys = tf.compat.v1.GraphKeys
VARIABLE_KEYS = (GraphKeys.GLOBAL_VARIABLES, GraphKeys.TRAINABLE_VARIABLES,
                 GraphKeys.TRAINABLE_RESOURCE_VARIABLES,
                 GraphKeys.MODEL_VARIABLES)


class VariableViews:
  """Per tower, its view of the variable collections (see the docstring)."""

  def __init__(self, graph: tf.Graph, num_towers: int,
               update_bound: Callable[[int], int]):
    # `update_bound(i)`: how far in tower 0's ops the updates tower i's
    # optimizer calls stand for reach (0: none yet).
    self._graph = graph
    self._update_bound = update_bound
    self._outer = {key: graph.get_collection(key) for key in VARIABLE_KEYS}
    self._tower0: Dict[str, list] = {key: [] for key in VARIABLE_KEYS}
    # Per key, per item of `_tower0`: from where in tower 0's ops it shows.
    self._shows_from: Dict[str, List[int]] = {}
    self._position = {}  # tower 0's op -> its index among the graph's ops
    self._reached = [0] * num_towers  # per tower, an exclusive op bound
    self._own: Dict[str, list] = {key: [] for key in VARIABLE_KEYS}

  def enter(self, index: int, replace: Callable) -> None:
    """Shows tower `index` (>= 1) tower 0's collections at its point."""
    for key in VARIABLE_KEYS:
      if (self._outer[key] or self._tower0[key] or
          key in self._graph.collections):
        replace(key, _TowerView(self._outer[key], self._tower0[key],
                                self._shows_from[key],
                                lambda i=index: self.bound(i)))

  def leave(self, index: int) -> None:
    """Records what tower `index` added (tower 0: what every tower sees)."""
    for key in VARIABLE_KEYS:
      now = self._graph.get_collection_ref(key) if (
          key in self._graph.collections) else []
      if index > 0:
        # A plain list: the tower made the collection, all of it its own.
        self._own[key].extend(now.own if isinstance(now, _TowerView) else now)
        continue
      self._tower0[key] = list(now[len(self._outer[key]):])
    if index == 0:
      self._order_tower0()

  def reach(self, index: int, variable) -> None:
    """Tower `index`'s creation resolved to tower 0's `variable` (a
    partitioned variable: to each of its parts)."""
    if index == 0:
      return
    for part in [variable] if hasattr(variable, "op") else _parts(variable):
      position = self._position.get(part.op)
      if position is not None:
        self._reached[index] = max(self._reached[index], position + 1)

  def bound(self, index: int) -> int:
    return max(self._reached[index], self._update_bound(index))

  def finish(self, replace: Callable) -> None:
    """Leaves each collection as tower 0 left it, plus the others' own."""
    for key in VARIABLE_KEYS:
      values = self._outer[key] + self._tower0[key]
      values += [v for v in self._own[key]
                 if not any(v is seen for seen in values)]
      if values or key in self._graph.collections:
        replace(key, values)

  def _order_tower0(self):
    """Where each of tower 0's additions shows: at its op, never before an
    earlier addition (an item without an op shows with the one before)."""
    ops = {id(item.op) for key in VARIABLE_KEYS for item in self._tower0[key]
           if hasattr(item, "op")}
    if ops:
      self._position = {op: i for i, op in enumerate(
          self._graph.get_operations()) if id(op) in ops}
    for key in VARIABLE_KEYS:
      shows, last = [], 0
      for item in self._tower0[key]:
        last = max(last, self._position.get(getattr(item, "op", None), -1) + 1)
        shows.append(last)
      self._shows_from[key] = shows


def _parts(variable) -> list:
  """The parts of a partitioned variable (it iterates over them)."""
  try:
    return [part for part in variable if hasattr(part, "op")]
  except TypeError:
    return []


class _TowerView(list):
  """A tower's collection: what it added itself, and tower 0's additions
  shown as the tower reaches their point (when the collection is read)."""

  def __init__(self, outer, tower0, shows_from, bound):
    super().__init__(outer)
    self.own = []
    self._tower0 = tower0
    self._shows_from = shows_from
    self._bound = bound
    self._shown = 0

  def _show(self):
    bound = self._bound()
    while (self._shown < len(self._tower0) and
           self._shows_from[self._shown] <= bound):
      list.append(self, self._tower0[self._shown])
      self._shown += 1

  def append(self, value):
    self._show()
    self.own.append(value)
    list.append(self, value)

  def __iter__(self):
    self._show()
    return list.__iter__(self)

  def __len__(self):
    self._show()
    return list.__len__(self)

  def __getitem__(self, item):
    self._show()
    return list.__getitem__(self, item)
