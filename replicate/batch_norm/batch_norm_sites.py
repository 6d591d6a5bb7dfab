"""The sites of synchronized batch norm: one per tower and layer call.

On the forward pass (two phases, as the gradient sums of
`replicate.gradients.apply_once`): at site k, tower i < N-1 computes its shard's
moments and reads stand-ins for the whole batch's (count, mean, variance)
(see `replicate.gradients.stand_ins`); the last tower has every tower's moments of
site k, combines them (`replicate.batch_norm.batch_moments`) and connects the
stand-ins. Sites are matched by their position in the tower, and checked by
name.

In a synchronous cluster the last tower also combines its task's moments
with every other task's (an all-gather of each task's), and the sum of
the gradients at a site is summed across tasks too.

On the backward pass: the whole batch's moments are a `tf.custom_gradient`
whose gradient in tower i is a stand-in for the sum over towers of what
each tower's loss sends back to them; the last tower's gradient function
makes the sum and connects it. Backward passes through a site are matched
by position too, so several optimizers may differentiate through one layer.
Only `TowerOptimizer`'s own (inside `BatchNormSync.backward`) may: every
tower makes its part of them, and each tower's loss is weighted before it
reaches the sum. Any other gradient through a site is refused.
"""

import contextlib
from typing import Any, List, Optional

import tensorflow as tf

from replicate.batch_norm import batch_moments
from replicate.call import current
from replicate.call import layout as layout_lib
from replicate.gradients import stand_ins
from replicate.shard import sharding
from replicate import _tf


class BatchNormSync:
  """The batch-norm sites of one TRAIN call: per tower, in build order."""

  def __init__(self, num_towers: int, has_rows: List[Any], sync_all: bool,
               refusal: Optional[str] = None, cross_task=None):
    self.sync_all = sync_all  # every layer, or only `synchronized=True` ones
    self.refusal = refusal  # why no site may be made here, if none may
    self._has_rows = has_rows
    # A synchronous cluster's collectives across tasks, or None.
    self._cross_task = cross_task
    self._sites = [[] for _ in range(num_towers)]
    # Tower 0's layers normalized per tower (sync_all False), in call order.
    self.per_tower_labels = []
    # "tower" or "extra" while TowerOptimizer differentiates (`backward`).
    self._backward = None

  @contextlib.contextmanager
  def backward(self, extra: bool = False):
    """`TowerOptimizer` builds a tower's backward pass inside.

    `extra` is `"replicated"`'s second pass in towers 1..N-1 towards tower
    0's own variables, which no tower's batch norm reads: it gets nothing
    through the sites.
    """
    previous, self._backward = self._backward, (
        "extra" if extra else "tower")
    try:
      yield
    finally:
      self._backward = previous

  @property
  def in_extra_pass(self) -> bool:
    """Whether `"replicated"`'s second pass is being built (`backward`)."""
    return self._backward == "extra"

  def per_tower(self, label: str) -> None:
    """Tower 0 calls the batch norm `label` with its shard's moments."""
    if label not in self.per_tower_labels:
      self.per_tower_labels.append(label)

  def synced(self, context, label: str, x, axes, mean, variance):
    """The whole batch's (count, mean, variance) for tower i's site."""
    if self.refusal:
      raise ValueError(self.refusal.format(label))
    index = context.progress.tower_index
    last = context.layout.num_towers - 1
    site = _Site(index, layout_lib.to_tower0_name(
        context.layout.graph.get_name_scope(), index), label)
    site.local = (batch_moments.element_count(x, axes, self._has_rows[index]),
                  mean, variance)
    site.position = len(self._sites[index])
    self._check_counterpart(site)
    self._sites[index].append(site)
    if index < last:
      site.batch = tuple(stand_ins.stand_in(t, "batch_norm_moments")
                         for t in site.local)
    else:
      sites = [tower[site.position] for tower in self._sites]
      with tf.name_scope("batch_norm_over_towers"):
        combined = batch_moments.combine(*zip(*[s.local for s in sites]),
                                         self._has_rows)
        if self._cross_task is not None:
          with context.progress.building_own_ops():  # not the model's state
            combined = batch_moments.combine_over_tasks(*combined,
                                                        self._cross_task)
        site.batch = tuple(tf.stop_gradient(t) for t in combined)
      for other in sites[:-1]:
        for stand_in, value in zip(other.batch, site.batch):
          stand_ins.connect(stand_in, value)
    batch_mean, batch_variance = self._with_gradient(site)
    return site.batch[0], batch_mean, batch_variance

  def _check_counterpart(self, site):
    """Tower 0's site at the same position has the same name.

    The last tower also needs every other tower's.
    """
    if site.tower == 0:
      return
    towers = self._sites[:site.tower]
    if site.tower < len(self._sites) - 1:
      towers = towers[:1]
    short = [i for i, sites in enumerate(towers) if len(sites) <= site.position]
    if short or self._sites[0][site.position].name != site.name:
      raise ValueError(
          "Tower {}'s synchronized batch norm {} (its number {}) has no "
          "counterpart in tower {}: each tower's model_fn must build the same "
          "batch-norm layers in the same order, whatever its data.".format(
              site.tower, site.label, site.position + 1,
              short[0] if short else 0))

  def _with_gradient(self, site):
    """(M, V), whose gradient goes to the tower's own moments, summed."""
    count, mean, variance = site.local

    @tf.custom_gradient
    def moments(mean, variance, batch_mean, batch_variance):
      def grad(grad_mean, grad_variance):
        grad_mean = _or_zeros(grad_mean, batch_mean)
        grad_variance = _or_zeros(grad_variance, batch_variance)
        summed = self._summed_gradient(site, grad_mean, grad_variance)
        if summed is None:
          return None, None, None, None
        weight = batch_moments.weight_of(count, site.batch[0], mean.dtype)
        return batch_moments.moments_gradient(
            weight, mean, batch_mean, *summed) + (None, None)
      return (tf.identity(batch_mean), tf.identity(batch_variance)), grad

    return moments(mean, variance, site.batch[1], site.batch[2])

  def _summed_gradient(self, site, grad_mean, grad_variance):
    """The sum over towers of their gradients at this site's (M, V)."""
    context = outer_context()
    if (context is None or context.batch_norm is not self or
        context.progress.tower_index != site.tower or
        self._backward is None):
      raise ValueError(
          "A gradient through the synchronized batch norm {} is made outside "
          "TowerOptimizer (tf.gradients, a GradientTape, or an optimizer not "
          "wrapped in TowerOptimizer). Its moments are the whole batch's, so "
          "tower {}'s rows feed every tower's loss, and only every tower's "
          "own backward pass, weighted and summed, gives one device's "
          "gradient. Fix: use TowerOptimizer.compute_gradients (or minimize) "
          "and change the gradients it returns before apply_gradients; or "
          "sync_batch_norm=False (per-tower batch norm).".format(
              site.label, site.tower))
    if self._backward == "extra":
      return None
    last = context.layout.num_towers - 1
    position = len(site.grads)
    site.grads.append((grad_mean, grad_variance))
    if site.tower < last:
      site.pending.append((stand_ins.stand_in(grad_mean, "batch_norm_gradient"),
                           stand_ins.stand_in(grad_variance,
                                            "batch_norm_gradient")))
      return site.pending[-1]
    sites = [tower[site.position] for tower in self._sites]
    if any(len(other.grads) <= position for other in sites):
      raise _unmatched(site, [len(other.grads) for other in sites])
    with tf.name_scope("batch_norm_gradient_over_towers"):
      summed = tuple(tf.math.add_n([
          sharding.zero_unless_rows(other.grads[position][part], rows)
          for other, rows in zip(sites, self._has_rows) if rows is not False])
                     for part in range(2))
      if self._cross_task is not None:
        with context.progress.building_own_ops():
          summed = tuple(self._cross_task.sum_all(
              summed, name="batch_norm_gradient_over_tasks"))
    for other in sites[:-1]:
      for stand_in, value in zip(other.pending[position], summed):
        stand_ins.connect(stand_in, value)
    return summed

  def finish(self) -> None:
    """Every site and backward pass met its counterparts in every tower."""
    tower0 = self._sites[0]
    for index, sites in enumerate(self._sites):
      if len(sites) < len(tower0):
        raise ValueError(
            "Tower {} built {} synchronized batch norm(s), fewer than tower "
            "0's {} ({} has no counterpart): each tower's model_fn must "
            "build the same batch-norm layers in the same order, whatever "
            "its data.".format(index, len(sites), len(tower0),
                               tower0[len(sites)].label))
    for position, site in enumerate(tower0):
      counts = [len(sites[position].grads) for sites in self._sites]
      if len(set(counts)) > 1:
        raise _unmatched(site, counts)


class _Site:
  """One tower's call of one batch-norm layer."""

  def __init__(self, tower, name, label):
    self.tower = tower
    self.name = name  # tower 0's name scope of the call
    self.label = label  # for messages
    self.position = None  # in the tower's sites
    self.local = None  # (count, mean, variance) of the tower's rows
    self.batch = None  # the whole batch's: stand-ins, or the combination
    self.grads = []  # per backward pass: (dL/dM, dL/dV) of this tower's loss
    self.pending = []  # per backward pass: stand-ins for their sums


def _unmatched(site, counts):
  return ValueError(
      "The towers made different numbers of backward passes through the "
      "synchronized batch norm {} ({}): its gradient is summed over towers, "
      "pass by pass, so every tower must differentiate through it with the "
      "same TowerOptimizer calls in the same order. Make the optimizer "
      "calls independent of the tower's data.".format(
          site.label, ", ".join("tower {}: {}".format(i, n)
                                for i, n in enumerate(counts))))


def _or_zeros(grad, like):
  return tf.zeros_like(like) if grad is None else grad


def outer_context():
  """The replication context of the graph, or of the graph this one is in."""
  for graph in _tf.enclosing_graphs(tf.compat.v1.get_default_graph()):
    context = current.current_context(graph)
    if context is not None:
      return context
  return None
