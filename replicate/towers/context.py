"""The replication context: the state of one wrapped `model_fn` call.

On lifetime: `replication_context(...)` creates one `ReplicationContext` for
the graph being built, makes it findable by `current.current_context()` while the
towers are built, and removes every trace of it from the graph in `finally`,
whether the towers were built or raised. Nothing is kept in module globals.

On towers: `tower_scope(i)` enters what tower i is built in: its device
function, no name-scope prefix for tower 0 and `tower_i` for the others,
variable reuse for towers 1..N-1, and the same fresh name counters tower 0
had, so that default-named scopes and layers (`dense`, `accuracy`) get the
names tower 0 gave them and resolve to tower 0's variables (through the
variable creator and getter of `replicate.variables.matching`).
"""

import contextlib
import dataclasses
from typing import Any, Callable, List, NamedTuple, Sequence

import tensorflow as tf

from replicate.variables import matching
from replicate.towers import name_counters
from replicate.gradients import optimizer_calls
from replicate.shard import rows
from replicate.towers import scaffolds
from replicate.shard import sharding
from replicate.variables import strategies
from replicate.towers import current
from replicate.towers import tower_collections
from replicate.gradients import weighting


@dataclasses.dataclass(frozen=True, eq=False)  # eq: it holds tensors
class Tower:
  """What is fixed for tower `index` in one call, built once per call."""
  index: int
  device: str
  device_function: Callable  # places the tower's ops (`towers.devices`)
  features: Any  # the tower's shard of the features
  labels: Any  # the tower's shard of the labels (None when labels are)
  share: Any  # its share of the batch n_i / n: a float or a scalar tensor
  has_rows: Any  # whether its outputs count: a bool or a scalar bool tensor


class TowerLayout(NamedTuple):
  """What is fixed for one call: the towers, the batch, the strategy."""
  towers: List[Tower]
  shards: sharding.Shards  # the batch's split (sizes, batch size, ...)
  strategy: strategies.VariableStrategy  # where variables live, how
  # gradients combine

  @classmethod
  def of(cls, devices: Sequence[str], device_functions: Sequence[Callable],
         shards: sharding.Shards,
         strategy: strategies.VariableStrategy) -> "TowerLayout":
    shares = sharding.shard_shares(shards.sizes, shards.batch_size)
    has_rows = sharding.shard_has_rows(shards.sizes)
    towers = [
        Tower(index, device, device_function, shards.features[index],
              shards.labels[index], shares[index], has_rows[index])
        for index, (device, device_function) in enumerate(
            zip(devices, device_functions))]
    return cls(towers, shards, strategy)

  @property
  def num_towers(self) -> int:
    return len(self.towers)

  @property
  def devices(self) -> List[str]:
    """Each tower's device, in tower order."""
    return [tower.device for tower in self.towers]

  @property
  def has_rows(self) -> List[Any]:
    """Whether each tower's outputs count, in tower order."""
    return [tower.has_rows for tower in self.towers]


class ReplicationContext:
  """Which tower is being built, and what the towers built so far.

  `layout` is what is fixed for the call; the rest changes as towers are
  built.
  """

  def __init__(self, graph, layout: TowerLayout, loss_reduction,
               tower_variables, batch_norm=None):
    self.graph = graph
    self.layout = layout
    self.num_towers = layout.num_towers
    self.tower_index = None  # the tower being built, or None
    # Each tower's optimizer calls, in order.
    self.records = optimizer_calls.OptimizerRecords(graph, self.num_towers)
    self.tower_ops = [[] for _ in range(self.num_towers)]  # ops each built
    self._first_op = [None] * self.num_towers  # where each tower's ops start
    # Ops replicate builds among a tower's (the gradient sums, the sum of
    # the loss denominators): not the user's, so not classified as state.
    self.own_ops = set()
    self._outer_name_scope = graph.get_name_scope()
    self._outer_variable_scope = tf.compat.v1.get_variable_scope()
    self._counters = name_counters.NameCounters(graph)
    sums_losses = loss_reduction == tf.compat.v1.losses.Reduction.SUM
    self.collections = tower_collections.TowerCollections(
        graph, self.num_towers, sums_losses)
    # Loss weights per tower, and the denominators that may replace them.
    self.weights = weighting.TowerWeights(
        sharding.shard_weights(layout.shards.sizes, layout.shards.batch_size,
                               loss_reduction), layout.has_rows, sums_losses)
    # For the variable creator (`replicate.variables.matching`): tower 0's variables,
    # and whether tower 0's update (the optimizer's slots) is being built.
    self.tower0_variables = matching.Tower0Variables()
    self.is_applying = False
    # The local variables and tables there were when tower 0 was built (a
    # `replicate.towers.scaffolds.LocalState`), for a model_fn's own local_init_op.
    self.local_state_after_tower0 = None
    # What each tower's variables are: tower 0's, or its own copies
    # (a `replicate.variables.tower_variables.TowerVariables`).
    self.variables = tower_variables
    # The synchronized batch norms of a TRAIN call (a
    # `replicate.batch_norm.sync_batch_norm.BatchNormSync`), or None.
    self.batch_norm = batch_norm

  @property
  def is_replicated(self) -> bool:
    """Whether towers 1..N-1 train their own copies of the variables."""
    return self.layout.strategy.copies_variables

  @property
  def is_last_tower(self) -> bool:
    return self.tower_index == self.num_towers - 1

  def tower_name_scope(self, index: int) -> str:
    """The name-scope prefix of tower `index` ('' for tower 0 at top level)."""
    if index == 0:
      return self._outer_name_scope
    return _join(self._outer_name_scope, "tower_{}".format(index))

  def to_tower0_name(self, name: str, index: int) -> str:
    """The name tower 0 gives to what tower `index` named `name`.

    Tower i's names are tower 0's with a `tower_i` scope added: at the front,
    and again wherever a model captured the absolute name scope it was built
    in (the TF 2 canned DNN names a layer that way). Every such component
    goes.
    """
    if index == 0:
      return name
    tower = "tower_{}".format(index)
    return "/".join(part for part in name.split("/") if part != tower)

  @contextlib.contextmanager
  def tower_scope(self, index: int):
    """Builds tower `index`: device, name scope, variable reuse, counters."""
    self.tower_index = index
    if index == 0:
      self._counters.save_start()
    else:
      self._counters.restore_start()
    self.collections.enter(index)
    first_op = len(self.graph.get_operations())
    self._first_op[index] = first_op
    try:
      with self.graph.device(self.layout.towers[index].device_function), \
          tf.compat.v1.variable_creator_scope(
              matching.variable_creator(self, index)):
        if index == 0:
          yield
        else:
          with tf.compat.v1.variable_scope(
              self._outer_variable_scope, reuse=True,
              custom_getter=matching.variable_getter(self, index),
              auxiliary_name_scope=False), self.graph.name_scope(
                  self.tower_name_scope(index) + "/"):
            yield
    finally:
      self.tower_ops[index] = self.graph.get_operations()[first_op:]
      self.collections.leave(index)
      if index == 0:
        self._counters.save_end_of_tower0()
        self.local_state_after_tower0 = scaffolds.local_state(self.graph)
      else:
        self._drop_summaries_of(index)
      self.tower_index = None

  def _drop_summaries_of(self, index):
    """Keeps one of each summary: tower 0's, under the model_fn's own tag.

    Tower i's copies (tagged `tower_i/...`) would add tags the unwrapped
    model_fn never writes; like MirroredStrategy, which records the first
    replica's, the summaries hold tower 0's shard. Summaries the aggregated
    update makes are built in tower 0's scopes, and are kept.
    """
    key = tf.compat.v1.GraphKeys.SUMMARIES
    if not self.graph.get_collection(key):
      return  # not get_collection_ref, which would add the collection
    prefix = self.tower_name_scope(index) + "/"
    summaries = self.graph.get_collection_ref(key)
    summaries[:] = [s for s in summaries
                    if not getattr(s, "name", "").startswith(prefix)]

  def finish_towers(self):
    """Leaves names and collections as the unwrapped model_fn would have.

    Also completes what waited for every tower: the sum of the towers'
    loss denominators; and checks that every synchronized batch norm met
    its counterparts.
    """
    self._counters.restore_end_of_tower0()
    self.collections.finish()
    with self.building_own_ops():
      self.weights.finish()
    if self.batch_norm is not None:
      self.batch_norm.finish()

  def ops_so_far(self, index: int) -> frozenset:
    """The ops tower `index` has built so far (all of them once it is done)."""
    if self.tower_index != index:
      return frozenset(self.tower_ops[index])
    return frozenset(self.graph.get_operations()[self._first_op[index]:])

  def rows_of(self, index: int) -> rows.TowerRows:
    """`replicate.shard.rows`'s rule for what tower `index` built so far."""
    tower = self.layout.towers[index]
    return rows.TowerRows((tower.features, tower.labels),
                          self.ops_so_far(index))

  @contextlib.contextmanager
  def building_own_ops(self):
    """What is built inside is replicate's own, not the model_fn's."""
    first_op = len(self.graph.get_operations())
    try:
      yield
    finally:
      self.own_ops.update(self.graph.get_operations()[first_op:])

  @contextlib.contextmanager
  def applying(self):
    """Tower 0 builds its update: the optimizer's own variables are made."""
    self.is_applying = True
    try:
      yield
    finally:
      self.is_applying = False


@contextlib.contextmanager
def replication_context(layout: TowerLayout, loss_reduction,
                        tower_variables, batch_norm=None):
  """Makes a `ReplicationContext` current for the default graph, then clears it."""
  graph = tf.compat.v1.get_default_graph()
  current.check_none(graph)  # before a second context touches the graph
  context = ReplicationContext(graph, layout, loss_reduction,
                               tower_variables, batch_norm)
  try:
    with current.made_current(graph, context):
      yield context
  finally:
    context.collections.finish()  # also when a tower raised


def _join(scope: str, name: str) -> str:
  return scope + "/" + name if scope else name
