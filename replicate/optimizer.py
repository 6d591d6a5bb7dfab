"""`TowerOptimizer`: collects every tower's gradients and applies them once.

On towers: outside `replicate_model_fn`, or with one tower, every call is
forwarded unchanged. Inside, `compute_gradients` weights the tower's loss by
its share of the batch (see `replicate.sharding`), `apply_gradients` records
the tower's gradients, and the last tower's call sums every tower's gradients
and applies them with tower 0's wrapped optimizer, in tower 0's scopes. Towers must
make the same calls in the same order; each call is matched by its position.
"""

from typing import Any, Callable, Union

import tensorflow as tf

from replicate import aggregation
from replicate import context as context_lib

_V1Optimizer = tf.compat.v1.train.Optimizer


class TowerOptimizer(_V1Optimizer):
  """Wraps an optimizer so that N towers make one update per step.

  Args:
    optimizer_or_optimizer_fn: a `tf.compat.v1.train.Optimizer` instance
      (`GradientDescentOptimizer`, `AdamOptimizer`, `SyncReplicasOptimizer`,
      ...), or a function of no arguments returning one. A function is called
      once per graph, the first time the optimizer is needed, so learning-rate
      tensors it builds land in the graph being trained.

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

  def __init__(self, optimizer_or_optimizer_fn: Union[_V1Optimizer,
                                                      Callable[[], Any]]):
    if not (isinstance(optimizer_or_optimizer_fn, _V1Optimizer) or
            callable(optimizer_or_optimizer_fn)):
      raise ValueError(
          "TowerOptimizer wraps a tf.compat.v1.train.Optimizer instance or a "
          "function of no arguments returning one. Received: {!r}.".format(
              optimizer_or_optimizer_fn))
    if isinstance(optimizer_or_optimizer_fn, TowerOptimizer):
      raise ValueError(
          "TowerOptimizer was given a TowerOptimizer; wrap the optimizer "
          "once. Received: {!r}.".format(optimizer_or_optimizer_fn))
    self._optimizer_or_optimizer_fn = optimizer_or_optimizer_fn
    self._built = None  # (graph, optimizer) for a function, per graph
    name = getattr(optimizer_or_optimizer_fn, "get_name", lambda: None)()
    super().__init__(use_locking=False, name=name or "TowerOptimizer")

  @property
  def optimizer(self) -> _V1Optimizer:
    """The wrapped optimizer (for a function: the one for this graph)."""
    if isinstance(self._optimizer_or_optimizer_fn, _V1Optimizer):
      return self._optimizer_or_optimizer_fn
    graph = tf.compat.v1.get_default_graph()
    if self._built is None or self._built[0] is not graph:
      optimizer = self._optimizer_or_optimizer_fn()
      if not isinstance(optimizer, _V1Optimizer):
        raise ValueError(
            "The function given to TowerOptimizer must return a "
            "tf.compat.v1.train.Optimizer. It returned: {!r}.".format(
                optimizer))
      self._built = (graph, optimizer)
    return self._built[1]

  def compute_gradients(self, loss, *args, **kwargs):
    """Weights the loss by this tower's share of the batch, then differentiates."""
    context = _active_context()
    if context is not None:
      loss = _weighted(loss, context.weights[context.tower_index])
    return self.optimizer.compute_gradients(loss, *args, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Records this tower's gradients; the last tower applies their sum once."""
    context = _active_context()
    if context is None:
      return self.optimizer.apply_gradients(grads_and_vars, global_step, name)
    position = context.record_optimizer_call(self, grads_and_vars)
    if not context.is_last_tower:
      return tf.no_op(name="tower_optimizer_collect")
    per_tower = _same_call_in_every_tower(context, position)
    # Tower 0's optimizer applies, in tower 0's scopes: its object is the one
    # the returned spec's hooks (tower 0's) refer to, e.g. a
    # SyncReplicasOptimizer's hook.
    tower0_call = context.optimizer_calls[0][position]
    with context.scopes_of(tower0_call):
      summed = aggregation.sum_grads_and_vars(per_tower, context.has_rows)
      return tower0_call.optimizer.optimizer.apply_gradients(
          summed, global_step, name)

  def get_slot(self, *args, **kwargs):
    return self.optimizer.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    return self.optimizer.get_slot_names(*args, **kwargs)

  def get_name(self):
    return self.optimizer.get_name()

  def variables(self):
    return self.optimizer.variables()

  def __getattr__(self, name):
    # Only reached for attributes TowerOptimizer does not have itself, such
    # as SyncReplicasOptimizer.make_session_run_hook.
    if name.startswith("__") or name == "_optimizer_or_optimizer_fn":
      raise AttributeError(name)
    return getattr(self.optimizer, name)


def _active_context():
  """The replication context, when more than one tower is being built."""
  context = context_lib.current_context()
  if context is None or context.tower_index is None or context.num_towers < 2:
    return None
  return context


def _weighted(loss, weight):
  if isinstance(weight, float) and weight == 1.0:
    return loss
  return loss * tf.cast(weight, loss.dtype)


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
        reference.optimizer.optimizer) or
        not _same_variables(call.grads_and_vars, reference.grads_and_vars)):
      raise ValueError(
          "Tower {}'s optimizer call {} differs from tower 0's (another kind "
          "of optimizer, or gradients for other variables): each tower's "
          "model_fn was supposed to make the same optimizer calls in the same "
          "order.".format(index, position + 1))
    per_tower.append(call.grads_and_vars)
  return per_tower


def _same_variables(grads_and_vars, other):
  # By identity: `==` on variables builds an elementwise comparison op.
  return len(grads_and_vars) == len(other) and all(
      a is b for (_, a), (_, b) in zip(grads_and_vars, other))
