"""`TowerOptimizer`: collects every tower's gradients and applies them once.

On towers: outside `replicate_model_fn`, or with one tower, every call is
forwarded unchanged. Inside, computing gradients weights the tower's loss by
its share of the batch (see `replicate.sharding`), applying them records the
tower's gradients, and the last tower's call sums every tower's gradients and
applies them with tower 0's wrapped optimizer, in the scopes tower 0 made its
call in. Towers must make the same calls in the same order; each call is
matched by its position.

On families: a `tf.compat.v1.train.Optimizer` is wrapped by `TowerOptimizer`
itself; a Keras legacy optimizer (`tf.keras.optimizers.legacy.*`, which the
TF 2 canned estimators take) by `KerasTowerOptimizer`, which
`TowerOptimizer(...)` returns for it. Each is an instance of the family it
wraps, since canned estimators check that.
"""

from typing import Any, Callable, Union

import tensorflow as tf

from replicate import aggregation
from replicate import context as context_lib
from replicate import hooks

_V1Optimizer = tf.compat.v1.train.Optimizer
_KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class _Wrapping:
  """What both families share: the wrapped optimizer, weighting, collecting."""

  _family = None  # the optimizer class a subclass wraps

  def _init_wrapping(self, optimizer_or_optimizer_fn):
    if isinstance(optimizer_or_optimizer_fn, (TowerOptimizer,
                                              KerasTowerOptimizer)):
      raise ValueError(
          "TowerOptimizer was given a TowerOptimizer; wrap the optimizer "
          "once. Received: {!r}.".format(optimizer_or_optimizer_fn))
    self._optimizer_or_optimizer_fn = optimizer_or_optimizer_fn
    self._built = None  # (graph, optimizer) for a function, per graph

  @property
  def optimizer(self):
    """The wrapped optimizer for the current graph."""
    wrapped = self._optimizer_or_optimizer_fn
    if isinstance(wrapped, _V1Optimizer):
      return wrapped  # keeps its per-graph state (slots) by graph itself
    graph = tf.compat.v1.get_default_graph()
    if self._built is None or self._built[0] is not graph:
      self._built = (graph, self._for_new_graph(wrapped))
    return self._built[1]

  def _for_new_graph(self, wrapped):
    if isinstance(wrapped, _KerasOptimizer):
      # A Keras legacy optimizer holds its variables (iterations, slots) for
      # one graph only, and TensorFlow refuses to reuse it in the next one
      # (the Estimator builds one per train, evaluate and export call): the
      # first graph gets the instance, each later one a copy of its config.
      if self._built is None:
        return wrapped
      return type(wrapped).from_config(wrapped.get_config())
    return _checked(wrapped(), self._family)

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


class TowerOptimizer(_Wrapping, _V1Optimizer):
  """Wraps an optimizer so that N towers make one update per step.

  Args:
    optimizer_or_optimizer_fn: a `tf.compat.v1.train.Optimizer` instance
      (`GradientDescentOptimizer`, `AdamOptimizer`, `SyncReplicasOptimizer`,
      ...), a Keras legacy optimizer (`tf.keras.optimizers.legacy.Adam()`,
      ..., for the TF 2 canned estimators), or a function of no arguments
      returning either. A function is called once per graph, the first time
      the optimizer is needed, so learning-rate tensors it builds land in the
      graph being trained (and once more at construction, in a scratch
      graph, to learn which family it returns). A Keras optimizer instance
      serves the first graph and a copy of its config each later one (the
      Estimator builds a graph per train, evaluate and export call, and a
      Keras optimizer's variables belong to one graph).

  On use: wrap the optimizer in the `model_fn`, or the one given to a canned
  estimator, and build the estimator from `replicate_model_fn(model_fn)`:

  ```python
  def model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(features["x"], 10, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.001))
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  estimator = tf.estimator.Estimator(replicate.replicate_model_fn(model_fn))
  ```

  On gradients: gradients are summed over towers (dense: `add_n`;
  `IndexedSlices`: concatenated). Since each tower's loss was weighted by its
  share of the batch, the sum is the gradient of the whole batch's loss.
  Gradients you compute yourself (without `compute_gradients` or `minimize`)
  are summed as they are: weight their loss as `compute_gradients` would.
  """

  _family = _V1Optimizer

  def __new__(cls, optimizer_or_optimizer_fn=None):
    if cls is TowerOptimizer and _family_of(
        optimizer_or_optimizer_fn) is _KerasOptimizer:
      return KerasTowerOptimizer(optimizer_or_optimizer_fn)
    return super().__new__(cls)

  def __init__(self, optimizer_or_optimizer_fn: Union[_V1Optimizer,
                                                      _KerasOptimizer,
                                                      Callable[[], Any]]):
    self._init_wrapping(optimizer_or_optimizer_fn)
    name = getattr(optimizer_or_optimizer_fn, "get_name", lambda: None)()
    super().__init__(use_locking=False, name=name or "TowerOptimizer")

  def compute_gradients(self, loss, var_list=None, *args, **kwargs):
    """Weights the loss by this tower's share of the batch, then differentiates.

    With replicated variables, tower i differentiates with respect to its
    own copies of `var_list` (default: the trainable variables).
    """
    return self.optimizer.compute_gradients(
        self._weighted_loss(loss), _tower_variables(var_list), *args,
        **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Records this tower's gradients; the last tower applies their sum once."""
    return self._collect_or_apply(
        grads_and_vars, lambda optimizer, grads: optimizer.apply_gradients(
            grads, global_step, name))

  def get_name(self):
    return self.optimizer.get_name()

  def make_session_run_hook(self, is_chief, num_tokens=-1):
    """The wrapped `SyncReplicasOptimizer`'s hook, closing promptly.

    Its chief otherwise waits 120 s at the end of training for gradients
    that no longer come (see `replicate.hooks.PromptSyncReplicasHook`).
    """
    wrapped = self.optimizer
    if isinstance(wrapped, tf.compat.v1.train.SyncReplicasOptimizer):
      return hooks.PromptSyncReplicasHook(wrapped, is_chief, num_tokens)
    return wrapped.make_session_run_hook(is_chief, num_tokens)


class KerasTowerOptimizer(_Wrapping, _KerasOptimizer):
  """`TowerOptimizer` for a Keras legacy optimizer (TF 2 canned estimators).

  Made by `replicate.TowerOptimizer(tf.keras.optimizers.legacy.Adam(...))`.
  `get_updates` (what the canned heads call), `minimize` and
  `apply_gradients` aggregate over towers like `TowerOptimizer`. Setting
  `iterations` to the global step once per tower, as the TF 2 canned
  `model_fn`s do, sets it once.
  """

  _family = _KerasOptimizer

  def __init__(self, optimizer_or_optimizer_fn):
    self._init_wrapping(optimizer_or_optimizer_fn)
    name = getattr(optimizer_or_optimizer_fn, "_name", None)
    super().__init__(name=name or "TowerOptimizer")

  def get_gradients(self, loss, params):
    return self.optimizer.get_gradients(self._weighted_loss(loss),
                                        _tower_variables(params))

  def get_updates(self, loss, params):
    grads = self.get_gradients(loss, params)
    return [self.apply_gradients(list(zip(grads, params)))]

  def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
    grads_and_vars = self.optimizer._compute_gradients(  # pylint: disable=protected-access
        self._weighted_loss(loss), var_list=_tower_variables(var_list),
        grad_loss=grad_loss, tape=tape)
    return self.apply_gradients(grads_and_vars, name=name)

  def apply_gradients(self, grads_and_vars, name=None,
                      experimental_aggregate_gradients=True):
    return self._collect_or_apply(
        grads_and_vars, lambda optimizer, grads: optimizer.apply_gradients(
            grads, name=name,
            experimental_aggregate_gradients=experimental_aggregate_gradients))

  @property
  def iterations(self):
    return self.optimizer.iterations

  @iterations.setter
  def iterations(self, variable):
    wrapped = self.optimizer
    if wrapped._iterations is not variable:  # pylint: disable=protected-access
      wrapped.iterations = variable

  @property
  def weights(self):
    return self.optimizer.weights

  def get_config(self):
    return self.optimizer.get_config()


def _family_of(optimizer_or_optimizer_fn):
  """The optimizer class `optimizer_or_optimizer_fn` is or makes."""
  for family in (_V1Optimizer, _KerasOptimizer):
    if isinstance(optimizer_or_optimizer_fn, family):
      return family
  if isinstance(optimizer_or_optimizer_fn, (TowerOptimizer,
                                            KerasTowerOptimizer)):
    return type(optimizer_or_optimizer_fn)._family
  if not callable(optimizer_or_optimizer_fn):
    raise ValueError(
        "TowerOptimizer wraps a tf.compat.v1.train.Optimizer, a "
        "tf.keras.optimizers.legacy.Optimizer, or a function of no arguments "
        "returning one. Received: {!r}.".format(optimizer_or_optimizer_fn))
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    return _family_of(_checked(optimizer_or_optimizer_fn(),
                               (_V1Optimizer, _KerasOptimizer)))


def _checked(optimizer, family):
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


def _tower_variables(var_list):
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
