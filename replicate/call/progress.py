"""How far the towers of one call are built, and what each built.

On progress: `ReplicationContext.tower_scope(i)` starts and ends tower i
here (`start`, `end`); in between, `tower_index` is i, and what the
`model_fn` builds is tower i's. Once a tower is done its ops, and what it
added to `UPDATE_OPS`, are kept for the build steps after the towers
(`replicate.state.rule`, `replicate.state.train_op`,
`replicate.outputs.specs`).

On replicate's own ops: what replicate builds among a tower's ops (the
gradient sums, the sum of the loss denominators) is built inside
`building_own_ops` and kept in `own_ops`, so that it is not classified as
the `model_fn`'s state.
"""

import contextlib
from typing import Any, Callable, List, Optional

from replicate.call import layout as layout_lib


class BuildProgress:
  """Which tower is being built, and what the towers built so far."""

  def __init__(self, layout: layout_lib.TowerLayout,
               rows_rule: Callable[..., Any]):
    # `replicate.shard.rows.TowerRows`, given by the context: what a
    # tower's ops computed from its rows (`rows_of`).
    self._rows_rule = rows_rule
    self._graph = layout.graph
    self._towers = layout.towers
    num_towers = layout.num_towers
    self.tower_index: Optional[int] = None  # the tower being built, or None
    self.tower_ops: List[list] = [[] for _ in range(num_towers)]  # ops each
    # built, in order
    self._first_op = [None] * num_towers  # where each tower's ops start
    # Per tower, what it added to UPDATE_OPS (see `tower_collections`).
    self.update_ops: List[list] = [[] for _ in range(num_towers)]
    self.own_ops = set()  # replicate's own ops among the towers'
    # Whether tower 0's update (the optimizer's slots) is being built, for
    # the variable creator (`replicate.variables.matching`).
    self.is_applying = False
    # The ops of tower 0's update, built by TowerOptimizer (`applying`).
    self.update_built = set()
    # Those of them its `gradient_transformers` built: every task builds
    # them, where a ps-held variable's update is the chief's alone
    # (`replicate.variables.ps_slices`).
    self.transformers_built = set()
    # Per update tower 0 built, how many ops the graph had after it: what
    # tower i has reached once it made as many optimizer calls
    # (`replicate.towers.variable_views`).
    self.update_ends: List[int] = []
    # The local variables and tables there were when tower 0 was built (a
    # `replicate.towers.scaffolds.LocalState`), for a model_fn's own
    # local_init_op.
    self.local_state_after_tower0 = None

  @property
  def is_last_tower(self) -> bool:
    return self.tower_index == len(self._towers) - 1

  def start(self, index: int) -> None:
    """Tower `index` is built from here on."""
    self.tower_index = index
    self._first_op[index] = len(self._graph.get_operations())

  def end(self, index: int, update_ops: list) -> None:
    """Tower `index` is done: keeps its ops and its `update_ops`."""
    self.tower_ops[index] = self._graph.get_operations()[
        self._first_op[index]:]
    self.update_ops[index] = list(update_ops)
    self.tower_index = None

  def ops_so_far(self, index: int) -> frozenset:
    """The ops tower `index` has built so far (all of them once it is done)."""
    if self.tower_index != index:
      return frozenset(self.tower_ops[index])
    return frozenset(self._graph.get_operations()[self._first_op[index]:])

  def rows_of(self, index: int, count_folded: bool = True):
    """`replicate.shard.rows`'s rule (a `TowerRows`) for what tower
    `index` built so far."""
    tower = self._towers[index]
    return self._rows_rule((tower.features, tower.labels),
                           self.ops_so_far(index), count_folded=count_folded)

  @contextlib.contextmanager
  def building_own_ops(self):
    """What is built inside is replicate's own, not the model_fn's."""
    first_op = len(self._graph.get_operations())
    try:
      yield
    finally:
      self.own_ops.update(self._graph.get_operations()[first_op:])

  @contextlib.contextmanager
  def applying(self):
    """Tower 0 builds its update: the optimizer's own variables are made."""
    self.is_applying = True
    first_op = len(self._graph.get_operations())
    try:
      yield
    finally:
      self.is_applying = False
      ops = self._graph.get_operations()
      self.update_built.update(ops[first_op:])
      self.update_ends.append(len(ops))
