"""What `TowerOptimizer` and `KerasTowerOptimizer` share.

On the wrapped optimizer: one per graph (the Estimator builds a graph per
train, evaluate and export call), made from the instance or function given.

On towers: computing gradients weights the tower's loss by its weight (see
`replicate.gradients.weighting`); gradients made otherwise are weighted when they
reach `apply_gradients` (`weighting.weighed_once`), so each counts its share once. Tower 0's `apply_gradients` builds the one update of
the step with the wrapped optimizer, in tower 0's scopes, on stand-ins for
the summed gradients (see `replicate.gradients.stand_ins`), so it returns the real update
and the optimizer's slots exist once it returns. Towers 1..N-1 record their
gradients and return tower 0's update; the last tower sums (or, with
replicated variables, all-reduces) every tower's gradients and connects the
sums to tower 0's update. Calls are matched across towers by position
(see `replicate.gradients.optimizer_calls`).

On `gradient_transformers`: functions `grads_and_vars -> grads_and_vars`
applied, in order, to the summed gradients before the update (with one
tower, and outside `replicate_model_fn`, to the gradients given).
"""

import contextlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from replicate import _tf
from replicate.gradients import aggregation
from replicate.towers import current
from replicate.gradients import optimizer_calls
from replicate.gradients import stand_ins
from replicate.shard import sharding
from replicate.gradients import weighting

V1Optimizer = tf.compat.v1.train.Optimizer
KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class Wrapping:
  """What both families share: the wrapped optimizer, weighting, collecting."""

  _family = None  # the optimizer class a subclass wraps

  def _init_wrapping(self, optimizer_or_optimizer_fn,
                     gradient_transformers: Optional[Sequence[Callable]]):
    if isinstance(optimizer_or_optimizer_fn, Wrapping):
      raise ValueError(
          "TowerOptimizer was given a TowerOptimizer; wrap the optimizer "
          "once. Received: {!r}.".format(optimizer_or_optimizer_fn))
    self._optimizer_or_optimizer_fn = optimizer_or_optimizer_fn
    self._gradient_transformers = _checked_transformers(gradient_transformers)
    self._built = None  # (graph, optimizer) for a function, per graph

  @property
  def optimizer(self):
    """The wrapped optimizer for the current graph."""
    wrapped = self._optimizer_or_optimizer_fn
    if isinstance(wrapped, V1Optimizer):
      return wrapped  # keeps its per-graph state (slots) by graph itself
    graph = tf.compat.v1.get_default_graph()
    if self._built is None or self._built[0] is not graph:
      self._built = (graph, self._for_new_graph(wrapped))
    return self._built[1]

  def _for_new_graph(self, wrapped):
    if isinstance(wrapped, KerasOptimizer):
      # A Keras legacy optimizer holds its variables (iterations, slots) for
      # one graph only, and TensorFlow refuses to reuse it in the next one
      # (the Estimator builds one per train, evaluate and export call): the
      # first graph gets the instance, each later one a copy of its config.
      if self._built is None:
        return wrapped
      return type(wrapped).from_config(wrapped.get_config())
    return checked(wrapped(), self._family)

  def _weighted_loss(self, loss):
    """The loss weighted for the current tower (see
    `weighting.TowerWeights.weigh_loss`).

    The result passes through an op of its own, recorded in the tower
    weights, so that `weighting.weighed_once` knows a gradient computed
    through it is weighted.
    """
    context = _active_context()
    if context is None:
      return loss
    index = context.progress.tower_index

    def weighted(value):
      value = context.weights.weigh_loss(
          index, value, context.progress.rows_of(index),
          strict_rows=context.progress.rows_of(index, count_folded=False))
      marker = tf.identity(tf.ones([], value.dtype), name="tower_weight")
      context.weights.add_weight_op(index, marker.op)
      return value * marker

    if callable(loss):
      return lambda: weighted(loss())
    return weighted(loss)

  def _transformed(self, grads_and_vars):
    for transform in self._gradient_transformers:
      grads_and_vars = list(transform(list(grads_and_vars)))
    return grads_and_vars

  def _collect_or_apply(self, grads_and_vars, apply):
    """Tower 0 builds the update; the other towers feed it their gradients.

    `apply(optimizer, grads_and_vars)` makes the update with the wrapped
    optimizer and the call's arguments (its `global_step` and `name`).
    Every tower gets back tower 0's update: what a tower makes wait for it
    (an `ExponentialMovingAverage`, a step counter) waits for the one
    update of the step.
    """
    context = _active_context()
    if context is None:
      return apply(self.optimizer, self._transformed(grads_and_vars))
    grads_and_vars = list(grads_and_vars)
    _check_not_in_control_flow(context)
    _check_not_sync_replicas(context, self.optimizer)
    _check_own_copies(context, grads_and_vars)
    grads_and_vars = weighting.weighed_once(context, grads_and_vars)
    index = context.progress.tower_index
    if index == 0:
      update = self._build_update(context, grads_and_vars, apply)
      if context.progress.is_last_tower:
        # One tower (a synchronous cluster's task): its sums are its own
        # gradients, summed across tasks.
        optimizer_calls.connect_sums(context,
                                     len(context.records.calls[0]) - 1)
      return update
    position = context.records.record(index, self, grads_and_vars, None)
    tower0_call = optimizer_calls.tower0_call(context, position)
    if context.progress.is_last_tower:
      optimizer_calls.connect_sums(context, position)
    return tower0_call.result

  def _build_update(self, context, grads_and_vars, apply):
    """Tower 0's update, on stand-ins for the sums over towers."""
    per_tower = [[(stand_ins.stand_in(grad, "pending_gradient"), variable)
                  for grad, variable in grads_and_vars]]
    if context.layout.is_replicated:
      # Every copy gets the same update in the same apply_gradients, so
      # that the optimizer's own step (Adam's beta powers) moves once.
      for index in range(1, context.layout.num_towers):
        copies = []
        for grad, variable in grads_and_vars:
          if grad is None:
            continue
          copy = context.variables.copy_early(index, variable)
          if copy is not variable:
            copies.append((stand_ins.stand_in(grad, "pending_gradient"), copy))
        per_tower.append(copies)
    with context.progress.applying():
      update = apply(self.optimizer, [
          pair for tower in per_tower for pair in self._transformed(tower)])
    context.records.record(
        0, self, grads_and_vars, update,
        pending=[pair for tower in per_tower for pair in tower])
    return update

  def _tower_gradients(self, compute, loss, variables):
    """`compute(loss, variables)` for this tower, as (gradient, variable).

    With replicated variables, tower i's loss may also read tower 0's
    variables themselves (the regularization losses every tower sees are
    tower 0's): that gradient belongs to tower i's copy too, since the copy
    and the variable hold the same value.
    """
    context = _active_context()
    originals = []
    if context is not None and context.layout.is_replicated and variables:
      originals = [context.variables.tower0_variable(v) for v in variables]
      originals = [v for v, copy in zip(originals, variables) if v is not copy]
    with backward_pass():
      own = list(compute(loss, list(variables)))
    if originals and not callable(loss):
      with backward_pass(extra=True):
        by_original = {v.ref(): g for v, g in zip(
            originals, tf.compat.v1.gradients(loss, originals))}
      for position, variable in enumerate(variables):
        extra = by_original.get(
            context.variables.tower0_variable(variable).ref())
        if extra is not None:
          own[position] = extra if own[position] is None else (
              aggregation.add_gradients([own[position], extra]))
    return list(zip(own, variables))

  def get_slot(self, *args, **kwargs):
    return self.optimizer.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    return self.optimizer.get_slot_names(*args, **kwargs)

  def variables(self):
    return self.optimizer.variables()

  def __getattr__(self, name):
    # Only reached for attributes the wrapper does not have itself, such as
    # SyncReplicasOptimizer.make_session_run_hook. Private names are never
    # forwarded: the optimizer base classes probe their own while the
    # wrapper is being constructed.
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self.optimizer, name)


def _checked_transformers(gradient_transformers) -> List[Callable]:
  if gradient_transformers is None:
    return []
  if callable(gradient_transformers) or not isinstance(
      gradient_transformers, (list, tuple)) or not all(
          callable(t) for t in gradient_transformers):
    raise ValueError(
        "TowerOptimizer(gradient_transformers=...) takes a list of "
        "functions, each taking and returning a list of (gradient, "
        "variable) pairs. Received: {!r}.".format(gradient_transformers))
  return list(gradient_transformers)


def checked(optimizer, family):
  if not isinstance(optimizer, family):
    raise ValueError(
        "The function given to TowerOptimizer must return a "
        "tf.compat.v1.train.Optimizer or a tf.keras.optimizers.legacy."
        "Optimizer. It returned: {!r}.".format(optimizer))
  return optimizer


def _check_not_sync_replicas(context, optimizer):
  """A synchronous cluster needs no `SyncReplicasOptimizer`: refused."""
  if (context.layout.cross_task is not None and
      isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer)):
    raise ValueError(
        "TowerOptimizer wraps a SyncReplicasOptimizer, but this RunConfig's "
        "cluster (chief and workers, no ps tasks) trains synchronously "
        "already: every task's towers apply the same sum each step. Wrap "
        "the SyncReplicasOptimizer's own optimizer instead, and drop its "
        "session hook.")


def _active_context():
  """The replication context, when more than one tower is being built."""
  context = current.current_context()
  if (context is None or context.progress.tower_index is None or
      not context.layout.combines):
    return None
  return context


def backward_pass(extra=False):
  """Where `TowerOptimizer` differentiates: the only gradients a synchronized
  batch norm lets through (`extra`: `"replicated"`'s second pass, none)."""
  context = _active_context()
  if context is None or context.batch_norm is None:
    return contextlib.nullcontext()
  return context.batch_norm.backward(extra)


def tower_variables(var_list):
  """`var_list` as the tower being built sees it: its copies, if it has any.

  Tower 0's variables stand for themselves; with replicated variables, tower
  i (i >= 1) trains its own copies. None means the trainable variables,
  which are tower 0's, so they are mapped too.
  """
  context = _active_context()
  if (context is None or not context.layout.is_replicated or
      context.progress.tower_index == 0):
    return var_list
  if var_list is None:
    var_list = (tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
  if callable(var_list):
    return var_list
  index = context.progress.tower_index
  return [context.variables.in_tower(index, v)
          for v in tf.nest.flatten(var_list)]


def _check_not_in_control_flow(context):
  """An optimizer call inside a tower's tf.cond or tf.function is refused.

  The one update of the step sums every tower's gradients; a call inside
  one tower's `tf.cond` branch (a NaN guard) or `tf.function` lives in
  that tower's own function graph, which no other tower's gradients can
  reach.
  """
  graph = tf.compat.v1.get_default_graph()
  if graph.building_function or _tf.in_control_flow(graph):
    raise ValueError(
        "Tower {} calls TowerOptimizer.apply_gradients (or minimize) inside "
        "a tf.cond, a tf.while_loop or a tf.function. The step's one update "
        "sums every tower's gradients, which a call inside one tower's "
        "branch cannot reach, so replicate_model_fn cannot make it. Fix: "
        "call the optimizer unconditionally. For a NaN guard, wrap the "
        "optimizer, inside TowerOptimizer, in tf.compat.v1.train."
        "experimental.MixedPrecisionLossScaleOptimizer(optimizer, "
        "tf.compat.v1.mixed_precision.DynamicLossScale("
        "initial_loss_scale=1, multiplier=1)): it skips the update on every "
        "tower when any tower's gradients are not finite (global_step does "
        "not advance on a skipped step) and leaves the gradients "
        "unscaled.".format(context.progress.tower_index))


def _check_own_copies(context, grads_and_vars):
  """A replicated tower must bring gradients for its copies, not tower 0's.

  Its loss was computed from its copies, so a gradient it took with respect
  to tower 0's variable (`tf.gradients(loss, tf.trainable_variables())`) is
  None or wrong; training on it would leave the copies behind unnoticed.
  """
  index = context.progress.tower_index
  if not context.layout.is_replicated or index == 0:
    return
  for _, variable in grads_and_vars:
    copy = context.variables.in_tower(index, variable)
    if copy is not variable:
      raise ValueError(
          "variable_strategy='replicated': tower {} applies a gradient for "
          "tower 0's variable {!r}, but it computes with its own copy {!r}. "
          "Take gradients with TowerOptimizer.compute_gradients(loss) (or "
          "minimize), which differentiates with respect to each tower's "
          "copies, and zip them with the variables compute_gradients "
          "returns, not with tf.compat.v1.trainable_variables() (tower "
          "0's); or differentiate with respect to the variables the "
          "tower's layers hold. Then clip or change them and call "
          "apply_gradients.".format(
              index, variable.op.name, copy.op.name))
