"""The replication context: one wrapped `model_fn` call's towers, built.

On lifetime: `replication_context(...)` creates one `ReplicationContext` for
the graph being built, makes it findable by `current.current_context()` while the
towers are built, and removes every trace of it from the graph in `finally`,
whether the towers were built or raised. Nothing is kept in module globals.

On its pieces: the context owns one object per concern, and each build step
is given, or reads, only the pieces it needs:
- `layout` (`replicate.call.layout.TowerLayout`): what is fixed for the
  call: the graph, the towers, the batch's split, the strategy;
- `progress` (`replicate.call.progress.BuildProgress`): which tower is
  being built, and what each tower built;
- `records` (`replicate.gradients.optimizer_calls.OptimizerRecords`): each
  tower's optimizer calls;
- `weights` (`replicate.gradients.weighting.TowerWeights`): each tower's
  loss weight;
- `collections`, `variables`, `tower0_variables`, `batch_norm`: what each
  tower sees of the graph's collections, what its variables are, tower 0's
  variables in order, and the synchronized batch norms (or None).
Code the `model_fn` reaches (`TowerOptimizer`, `loss_denominator`,
`tower_local_scope`, batch norm) finds the context through
`current.current_context()` and reads its own pieces.

On towers: `tower_scope(i)` enters what tower i is built in: its device
function, no name-scope prefix for tower 0 and `tower_i` for the others,
variable reuse for towers 1..N-1, and the same fresh name counters tower 0
had, so that default-named scopes and layers (`dense`, `accuracy`) get the
names tower 0 gave them and resolve to tower 0's variables (through the
variable creator and getter of `replicate.variables.matching`).
"""

import contextlib

import tensorflow as tf

from replicate import _tf
from replicate.call import current
from replicate.call import colocation
from replicate.call import layout as layout_lib
from replicate.call import name_counters
from replicate.call import progress as progress_lib
from replicate.gradients import optimizer_calls
from replicate.gradients import weighting
from replicate.shard import rows
from replicate.towers import all_rows_calls
from replicate.towers import scaffolds
from replicate.towers import tower_collections
from replicate.variables import matching


class ReplicationContext:
  """The pieces of one call's build, and `tower_scope(i)` to build tower i."""

  def __init__(self, layout: layout_lib.TowerLayout, loss_reduction,
               tower_variables, batch_norm=None):
    graph = layout.graph
    self.layout = layout
    self.progress = progress_lib.BuildProgress(layout, rows.TowerRows)
    self.records = optimizer_calls.OptimizerRecords(graph, layout.num_towers)
    self._outer_name_scope = graph.get_name_scope()
    self._outer_variable_scope = tf.compat.v1.get_variable_scope()
    self._counters = name_counters.NameCounters(graph)
    sums_losses = loss_reduction == tf.compat.v1.losses.Reduction.SUM
    self._sums_losses = sums_losses
    self.collections = tower_collections.TowerCollections(
        graph, layout.num_towers, sums_losses,
        copies_variables=layout.is_replicated,
        update_bound=self._update_bound)
    # Loss weights per tower (1 for SUM, else the tower's share n_i / n,
    # built once, by the layout), and the denominators that may replace them.
    self.weights = weighting.TowerWeights(
        [1.0] * layout.num_towers if sums_losses else
        [tower.share for tower in layout.towers], layout.has_rows,
        sums_losses, layout.sum_over_tasks,
        shares=[tower.share for tower in layout.towers],
        reduction=loss_reduction, is_first_task=layout.is_first_task,
        row_counts=_row_counts(layout))
    # For the variable creator (`replicate.variables.matching`): tower 0's
    # variables, in order.
    self.tower0_variables = matching.Tower0Variables()
    # What each tower's variables are: tower 0's, or its own copies
    # (a `replicate.variables.tower_variables.TowerVariables`).
    self.variables = tower_variables
    # The synchronized batch norms of a TRAIN call (a
    # `replicate.batch_norm.batch_norm_sites.BatchNormSync`), or None.
    self.batch_norm = batch_norm
    # The calls of `replicate.all_rows`, per tower.
    self.all_rows = all_rows_calls.AllRows(layout.num_towers)

  def _update_bound(self, index: int) -> int:
    """How far in the graph's ops tower 0's updates reach that tower
    `index`'s optimizer calls so far stand for (0: none)."""
    calls = min(len(self.records.calls[index]),
                len(self.progress.update_ends))
    return self.progress.update_ends[calls - 1] if calls else 0

  def tower_name_scope(self, index: int) -> str:
    """The name-scope prefix of tower `index` ('' for tower 0 at top level)."""
    if index == 0:
      return self._outer_name_scope
    return _join(self._outer_name_scope, "tower_{}".format(index))

  @contextlib.contextmanager
  def tower_scope(self, index: int):
    """Builds tower `index`: device, name scope, variable reuse, counters."""
    graph = self.layout.graph
    if index == 0:
      self._counters.save_start()
    else:
      self._counters.restore_start()
    self.collections.enter(index)
    self.progress.start(index)
    try:
      with graph.device(self.layout.towers[index].device_function), \
          self.layout.strategy.tower_scope(index), \
          tf.compat.v1.variable_creator_scope(
              matching.variable_creator(self, index)):
        if index == 0:
          yield
        else:
          with tf.compat.v1.variable_scope(
              self._outer_variable_scope, reuse=True,
              custom_getter=matching.variable_getter(self, index),
              auxiliary_name_scope=False), graph.name_scope(
                  self.tower_name_scope(index) + "/"):
            yield
    finally:
      self.collections.leave(index)
      self.progress.end(index, self.collections.update_ops(index))
      if index == 0:
        self._counters.save_end_of_tower0()
        self.progress.local_state_after_tower0 = scaffolds.local_state(graph)
      else:
        self._drop_summaries_of(index)

  def _drop_summaries_of(self, index):
    """Keeps one of each summary: tower 0's, under the model_fn's own tag.

    Tower i's copies (tagged `tower_i/...`) would add tags the unwrapped
    model_fn never writes; like MirroredStrategy, which records the first
    replica's, the summaries are tower 0's, and what they show of values
    over the batch is the whole batch's (`replicate.outputs.summaries`).
    Summaries the aggregated update makes are built in tower 0's scopes,
    and are kept. TF 2's write ops and writer initializers too: tower i's
    writer, never initialized, would fail the step that runs its writes.
    """
    graph = self.layout.graph
    prefix = self.tower_name_scope(index) + "/"
    for key in _tf.SUMMARY_COLLECTIONS:
      if not graph.get_collection(key):
        continue  # not get_collection_ref, which would add the collection
      summaries = graph.get_collection_ref(key)
      summaries[:] = [s for s in summaries
                      if not getattr(s, "name", "").startswith(prefix)]

  def finish_towers(self):
    """Leaves names and collections as the unwrapped model_fn would have.

    Also completes what waited for every tower: the sum of the towers'
    loss denominators and `replicate.all_rows`'s whole batch; and checks
    that every synchronized batch norm met its counterparts.
    """
    self._counters.restore_end_of_tower0()
    self._check_summed_regularization()
    self.collections.finish()
    with self.progress.building_own_ops():
      self.weights.finish()
      self.all_rows.finish(self.layout)
    if self.batch_norm is not None:
      self.batch_norm.finish()
    colocation.place_colocated(self.layout.graph, [
        op for ops in self.progress.tower_ops for op in ops])

  def _check_summed_regularization(self):
    """With `Reduction.SUM` across tasks, regularization would count once a
    task: refused (an averaging reduction weighs it by the shares)."""
    if not self.layout.spans_tasks or not self._sums_losses:
      return
    losses = self.collections.regularization()
    if losses:
      raise ValueError(
          "loss_reduction=Reduction.SUM with regularization losses ({}) in "
          "a synchronous cluster: the towers' losses are summed as they "
          "are, and each task's tower 0 holds the regularization, so it "
          "would count once per task. Fix: an averaging loss_reduction "
          "(the default SUM_BY_NONZERO_WEIGHTS, or MEAN) for a loss "
          "averaged over its rows, or train with ps tasks.".format(
              ", ".join(repr(t.op.name) for t in losses[:3]) +
              (", ..." if len(losses) > 3 else "")))


@contextlib.contextmanager
def replication_context(layout: layout_lib.TowerLayout, loss_reduction,
                        tower_variables, batch_norm=None):
  """Makes a `ReplicationContext` current for the layout's graph, then
  clears it.

  The hand-off from step 2 to steps 3-5: the towers are built inside, with
  `context.tower_scope(i)`; what the `model_fn` reaches (`TowerOptimizer`,
  `loss_denominator`, batch norm) fills the context's pieces.

  Args:
    layout: the call's `TowerLayout`.
    loss_reduction: how the `model_fn` reduces its loss (a
      `tf.compat.v1.losses.Reduction`).
    tower_variables: what each tower's variables are (a
      `replicate.variables.tower_variables.TowerVariables`).
    batch_norm: the synchronized batch norms of a TRAIN call, or None.

  Yields:
    The `ReplicationContext`, current in the layout's graph until the
    `with` ends, whether the towers were built or raised.

  Raises:
    ValueError: another wrapped `model_fn` is being built in the graph.
  """
  graph = layout.graph
  current.check_none(graph)  # before a second context touches the graph
  context = ReplicationContext(layout, loss_reduction, tower_variables,
                               batch_norm)
  try:
    with current.made_current(graph, context):
      yield context
  finally:
    context.collections.finish()  # also when a tower raised


def _join(scope: str, name: str) -> str:
  return scope + "/" + name if scope else name


def _row_counts(layout):
  """Per tower, its static row count where the towers' counts differ from
  the whole batch's (several towers or tasks, a batch of known size); a
  tower without rows is built on one stand-in row. Else None."""
  sizes = layout.shards.sizes
  if not layout.combines or not isinstance(sizes, list):
    return None
  whole = layout.shards.batch_size
  return [None if not layout.spans_tasks and max(size, 1) == whole
          else max(size, 1) for size in sizes]
