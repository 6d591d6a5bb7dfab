"""What `TowerOptimizer` and `KerasTowerOptimizer` share.

On the wrapped optimizer: one per graph (the Estimator builds a graph per
train, evaluate and export call), made from the instance or function given.

On towers: computing gradients weights the tower's loss by its share of the
batch; applying them records the tower's call, and the last tower's call
sums (or, with replicated variables, all-reduces) every tower's gradients
and applies them once, with tower 0's optimizer, in tower 0's scopes. Calls
are matched across towers by their position.
"""

import tensorflow as tf

from replicate import aggregation
from replicate import context as context_lib

V1Optimizer = tf.compat.v1.train.Optimizer
KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class Wrapping:
  """What both families share: the wrapped optimizer, weighting, collecting."""

  _family = None  # the optimizer class a subclass wraps

  def _init_wrapping(self, optimizer_or_optimizer_fn):
    if isinstance(optimizer_or_optimizer_fn, Wrapping):
      raise ValueError(
          "TowerOptimizer was given a TowerOptimizer; wrap the optimizer "
          "once. Received: {!r}.".format(optimizer_or_optimizer_fn))
    self._optimizer_or_optimizer_fn = optimizer_or_optimizer_fn
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
    """The loss weighted by the current tower's share of the batch."""
    context = _active_context()
    if context is None:
      return loss
    weight = context.weights[context.tower_index]
    if isinstance(weight, float) and weight == 1.0:
      return loss
    if callable(loss):
      return lambda: loss() * tf.cast(weight, tf.float32)
    return loss * tf.cast(weight, loss.dtype)

  def _collect_or_apply(self, grads_and_vars, apply):
    """Records the tower's gradients; in the last tower, applies their sum.

    `apply(optimizer, grads_and_vars)` makes the update. The sum is applied
    with tower 0's optimizer and tower 0's `apply` (its `global_step` and
    `name`): tower 0's optimizer object is the one the returned spec's hooks
    (tower 0's) refer to, e.g. a SyncReplicasOptimizer's hook.
    """
    context = _active_context()
    if context is None:
      return apply(self.optimizer, grads_and_vars)
    grads_and_vars = list(grads_and_vars)
    _check_own_copies(context, grads_and_vars)
    if not context.is_last_tower:
      collected = tf.no_op(name="tower_optimizer_collect")
      context.record_optimizer_call(self, grads_and_vars, apply, collected)
      return collected
    position = context.record_optimizer_call(self, grads_and_vars, apply,
                                             None)
    per_tower = _same_call_in_every_tower(context, position)
    tower0_call = context.optimizer_calls[0][position]
    with context.scopes_of(tower0_call):
      if context.is_replicated:
        summed = aggregation.all_reduce_grads_and_vars(
            per_tower, context.has_rows, context.devices,
            context.aggregation.all_reduce,
            context.aggregation.compact_gradients)
      else:
        summed = aggregation.sum_grads_and_vars(
            per_tower, context.has_rows, context.aggregation.sum_device)
      update = tower0_call.apply(tower0_call.optimizer.optimizer, summed)
    update_op = getattr(update, "op", update)
    for calls in context.optimizer_calls[:-1]:
      # What an earlier tower's apply_gradients returned stands for the
      # update, as it would unwrapped: what waits for it (a global-step
      # increment after training) must wait for the update.
      calls[position].result._add_control_input(update_op)  # pylint: disable=protected-access
    return update

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


def checked(optimizer, family):
  if not isinstance(optimizer, family):
    raise ValueError(
        "The function given to TowerOptimizer must return a "
        "tf.compat.v1.train.Optimizer or a tf.keras.optimizers.legacy."
        "Optimizer. It returned: {!r}.".format(optimizer))
  return optimizer


def _active_context():
  """The replication context, when more than one tower is being built."""
  context = context_lib.current_context()
  if context is None or context.tower_index is None or context.num_towers < 2:
    return None
  return context


def tower_variables(var_list):
  """`var_list` as the tower being built sees it: its copies, if it has any.

  Tower 0's variables stand for themselves; with replicated variables, tower
  i (i >= 1) trains its own copies. None means the trainable variables,
  which are tower 0's, so they are mapped too.
  """
  context = _active_context()
  if context is None or not context.is_replicated or context.tower_index == 0:
    return var_list
  if var_list is None:
    var_list = (tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
  if callable(var_list):
    return var_list
  return [context.variables.in_tower(context.tower_index, v)
          for v in tf.nest.flatten(var_list)]


def _check_own_copies(context, grads_and_vars):
  """A replicated tower must bring gradients for its copies, not tower 0's.

  Its loss was computed from its copies, so a gradient it took with respect
  to tower 0's variable (`tf.gradients(loss, tf.trainable_variables())`) is
  None or wrong; training on it would leave the copies behind unnoticed.
  """
  index = context.tower_index
  if not context.is_replicated or index == 0:
    return
  for _, variable in grads_and_vars:
    copy = context.variables.in_tower(index, variable)
    if copy is not variable:
      raise ValueError(
          "variable_strategy='replicated': tower {} applies a gradient for "
          "tower 0's variable {!r}, but it computes with its own copy {!r}. "
          "Take gradients with TowerOptimizer.compute_gradients(loss) (or "
          "minimize), which differentiates with respect to each tower's "
          "copies, or with respect to the variables the tower's layers "
          "hold, then clip or change them and call apply_gradients.".format(
              index, variable.op.name, copy.op.name))


def _same_call_in_every_tower(context, position):
  """Every tower's gradients for call `position`, checked to be alike."""
  first = context.optimizer_calls[0]
  if len(first) <= position:
    raise ValueError(
        "Tower {} made {} TowerOptimizer.apply_gradients calls, more than "
        "tower 0's {}: each tower's model_fn was supposed to make the same "
        "optimizer calls in the same order. Make the calls independent of "
        "the tower's data.".format(context.tower_index, position + 1,
                                   len(first)))
  reference = first[position]
  per_tower = []
  for index, calls in enumerate(context.optimizer_calls):
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
