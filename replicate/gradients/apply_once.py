"""What `TowerOptimizer` and `KerasTowerOptimizer` share.

On the wrapped optimizer: one per graph (the Estimator builds a graph per
train, evaluate and export call), made from the instance or function given.

On towers: computing gradients weights the tower's loss by its weight (see
`replicate.gradients.weighting`) and returns stand-ins for the sums over
towers (`TowerOptimizerCore._whole_batch`), so that the `model_fn`'s code
between `compute_gradients` and `apply_gradients` sees the whole batch's
gradients; what `apply_gradients` receives computed from them is applied
once, as it is (a replicated copy gets its own tower's). Gradients made
otherwise are weighted when they reach `apply_gradients`
(`gradient_weights.weighted_once`), so each counts its share once, and the
user's ops that changed them are made to read sums too
(`replicate.gradients.touched`). Tower 0's `apply_gradients` builds the one
update of the step with the wrapped optimizer, in tower 0's scopes, on
stand-ins for the summed gradients (see `replicate.gradients.stand_ins`), so
it returns the real update and the optimizer's slots exist once it returns.
Towers 1..N-1 record their gradients and return tower 0's update; the last
tower sums (or, with replicated variables, all-reduces) every tower's
gradients and connects the sums to tower 0's update. Calls are matched
across towers by position (see `replicate.gradients.optimizer_calls`).

On `gradient_transformers`: functions `grads_and_vars -> grads_and_vars`
applied, in order, to the summed gradients before the update (with one
tower, and outside `replicate_model_fn`, to the gradients given).
"""

import contextlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from replicate import _tf
from replicate.gradients import aggregation
from replicate.gradients import call_checks
from replicate.call import current
from replicate.gradients import optimizer_calls
from replicate.gradients import stand_ins
from replicate.gradients import touched
from replicate.shard import sharding
from replicate.gradients import gradient_weights
from replicate.gradients import weighting

V1Optimizer = tf.compat.v1.train.Optimizer
KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class TowerOptimizerCore:
  """What both families share: the wrapped optimizer, weighting, collecting."""

  _family = None  # the optimizer class a subclass wraps

  def _init_core(self, optimizer_or_optimizer_fn,
                 gradient_transformers: Optional[Sequence[Callable]]):
    if isinstance(optimizer_or_optimizer_fn, TowerOptimizerCore):
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
    weights, so that `gradient_weights.weighted_once` knows a gradient
    computed through it is weighted.
    """
    context = _active_context()
    if context is None:
      return loss
    progress, weights = context.progress, context.weights
    index = progress.tower_index

    def weighted(value):
      value = weights.weigh_loss(
          index, value, progress.rows_of(index),
          strict_rows=progress.rows_of(index, count_folded=False))
      marker = tf.identity(tf.ones([], value.dtype), name="tower_weight")
      weights.add_weight_op(index, marker.op)
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
    call_checks.not_in_control_flow(context)
    call_checks.not_sync_replicas(context, self.optimizer)
    call_checks.own_copies(context, grads_and_vars)
    index = context.progress.tower_index
    grads_and_vars, touched_here = touched.made_whole(
        context, grads_and_vars,
        lambda grad: gradient_weights.weighted_once(
            context, [(grad, None)])[0][0],
        set(context.records.whole_ops(index)))
    context.records.add_whole(index, [t.stand_in for t in touched_here])
    whole = gradient_weights.whole_batch(context, grads_and_vars)
    grads_and_vars = gradient_weights.weighted_once(context, grads_and_vars,
                                                    whole)
    if index == 0:
      update = self._build_update(
          grads_and_vars, apply, whole, touched_here,
          variables=context.variables, num_towers=context.layout.num_towers,
          progress=context.progress, records=context.records)
      if context.progress.is_last_tower:
        # One tower (a synchronous cluster's task): its sums are its own
        # gradients, summed across tasks.
        optimizer_calls.connect_sums(context,
                                     len(context.records.calls[0]) - 1)
      return update
    position = context.records.record(index, self, grads_and_vars, None,
                                      whole=whole, touched=touched_here)
    tower0_call = optimizer_calls.tower0_call(context, position)
    call_checks.same_whole(context, tower0_call, whole, grads_and_vars)
    if context.progress.is_last_tower:
      optimizer_calls.connect_sums(context, position)
    return tower0_call.result

  def _build_update(self, grads_and_vars, apply, whole, touched_here, *,
                    variables, num_towers, progress, records):
    """Tower 0's update, on stand-ins for the sums over towers.

    A gradient that is already the whole batch's (`whole`) is applied as
    it is; a replicated copy's stand-in for it is connected to its tower's.

    It is given what it reads of the call: its `variables` (a replicated
    tower's copies), `num_towers`, `progress` (the update is built
    `applying`) and `records` (where tower 0's call goes).
    """
    tower0 = [(grad if is_whole else stand_ins.stand_in(
        grad, "pending_gradient"), variable)
              for is_whole, (grad, variable) in zip(whole, grads_and_vars)]
    standing_in = [pair for is_whole, pair in zip(whole, tower0)
                   if not is_whole]
    per_tower = [tower0]
    if variables.has_copies():
      # Every copy gets the same update in the same apply_gradients, so
      # that the optimizer's own step (Adam's beta powers) moves once.
      for index in range(1, num_towers):
        copies = []
        for grad, variable in grads_and_vars:
          if grad is None:
            continue
          copy = variables.copy_early(index, variable)
          if copy is not variable:
            copies.append((stand_ins.stand_in(grad, "pending_gradient"), copy))
        per_tower.append(copies)
        standing_in.extend(copies)
    with progress.applying():
      first_op = len(tf.compat.v1.get_default_graph().get_operations())
      transformed = [pair for tower in per_tower
                     for pair in self._transformed(tower)]
      progress.transformers_built.update(
          tf.compat.v1.get_default_graph().get_operations()[first_op:])
      # What lives on a ps task only the first task updates.
      update = apply(self.optimizer, [pair for pair in transformed
                                      if variables.updates(pair[1])])
    records.record(0, self, grads_and_vars, update,
                   stand_in_pairs=standing_in, whole=whole,
                   touched=touched_here)
    return update

  def _whole_batch(self, grads_and_vars):
    """Stand-ins for the sums over towers of this tower's gradients.

    What `compute_gradients` returns inside `replicate_model_fn`: code
    between it and `apply_gradients` (clipping by global norm, scaling,
    noise, logging the norm) sees the whole batch's gradients, as on one
    device. Each stand-in passes the tower's own weighted gradient on until
    the last tower's call connects the sums (see
    `optimizer_calls.connect_whole_batch`).
    """
    context = _active_context()
    grads_and_vars = list(grads_and_vars)
    graph = tf.compat.v1.get_default_graph()
    if (context is None or graph.building_function or
        _tf.in_control_flow(graph)):
      return grads_and_vars  # apply_gradients there is refused anyway
    whole = [(stand_ins.whole_batch(grad), variable)
             for grad, variable in grads_and_vars]
    records, index = context.records, context.progress.tower_index
    position = records.record_gradients(index, grads_and_vars, whole)
    if index > 0 and len(records.gradient_calls[0]) <= position:
      raise ValueError(
          "Tower {} made {} TowerOptimizer.compute_gradients calls, more than "
          "tower 0's {}: each tower's model_fn was supposed to make the same "
          "optimizer calls in the same order. Make the calls independent of "
          "the tower's data.".format(
              index, position + 1, len(records.gradient_calls[0])))
    if context.progress.is_last_tower:
      optimizer_calls.connect_whole_batch(context, position)
    return whole

  def _tower_gradients(self, compute, loss, variables):
    """`compute(loss, variables)` for this tower, as (gradient, variable).

    With replicated variables, tower i's loss may also read tower 0's
    variables themselves (the regularization losses every tower sees are
    tower 0's): that gradient belongs to tower i's copy too, since the copy
    and the variable hold the same value.
    """
    context = _active_context()
    towers_variables = None if context is None else context.variables
    originals = []
    if towers_variables is not None and towers_variables.has_copies() and (
        variables):
      originals = [towers_variables.tower0_variable(v) for v in variables]
      originals = [v for v, copy in zip(originals, variables) if v is not copy]
    with backward_pass():
      own = list(compute(loss, list(variables)))
    if originals and not callable(loss):
      with backward_pass(extra=True):
        by_original = {v.ref(): g for v, g in zip(
            originals, tf.compat.v1.gradients(loss, originals))}
      for position, variable in enumerate(variables):
        extra = by_original.get(
            towers_variables.tower0_variable(variable).ref())
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
        "Optimizer. It returned: {!r}.{}".format(
            optimizer, KERAS_V2_HINT if isinstance(
                optimizer, tf.keras.optimizers.Optimizer) else ""))
  return optimizer


# A Keras optimizer of TF 2.11 and later runs eagerly, never in an
# Estimator's graph; what works in one's own model_fn instead.
KERAS_V2_HINT = (
    " A Keras optimizer of TF 2.11 and later (tf.keras.optimizers.Adam()) "
    "cannot run in an Estimator's graph. In your own model_fn use "
    "tf.compat.v1.train.AdamOptimizer(...) with minimize(loss, "
    "global_step=...), or tf.keras.optimizers.legacy.Adam(...) with "
    "optimizer.iterations = tf.compat.v1.train.get_global_step() and "
    "train_op = optimizer.get_updates(loss, params)[0], as the canned "
    "estimators call it (docs/api.md).")


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
  if context is None or not context.variables.has_copies(
      context.progress.tower_index):
    return var_list
  if var_list is None:
    var_list = (tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
  if callable(var_list):
    return var_list
  index = context.progress.tower_index
  return [context.variables.in_tower(index, v)
          for v in tf.nest.flatten(var_list)]
