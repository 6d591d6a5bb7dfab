"""`TowerOptimizer`: every tower's gradients, one update per step.

On towers: outside `replicate_model_fn`, or with one tower, every call is
forwarded unchanged (`gradient_transformers` apply). Inside, computing
gradients weights the tower's loss by its weight (see `replicate.gradients.weighting`);
tower 0's apply builds the one update with the wrapped optimizer, in its own
scopes, on stand-ins for the sums, and returns it; the other towers' applies
record their gradients and return tower 0's update, and the last one sums
every tower's gradients into it (see `replicate.gradients.apply_once`). Towers must make
the same calls in the same order; each call is matched by its position.

On families: a `tf.compat.v1.train.Optimizer` is wrapped by `TowerOptimizer`
itself; a Keras legacy optimizer (`tf.keras.optimizers.legacy.*`, which the
TF 2 canned estimators take) by `KerasTowerOptimizer`, which
`TowerOptimizer(...)` returns for it. Each is an instance of the family it
wraps, since canned estimators check that.
"""

from typing import Any, Callable, Optional, Sequence, Union

import tensorflow as tf

from replicate import _tf
from replicate.cluster import session_hooks
from replicate.gradients import apply_once

_V1Optimizer = apply_once.V1Optimizer
_KerasOptimizer = apply_once.KerasOptimizer
_Core = apply_once.TowerOptimizerCore  # what both families share


class TowerOptimizer(_Core, _V1Optimizer):
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
  `compute_gradients` returns the sums (stand-ins for them until the last
  tower is built), so code between it and `apply_gradients`
  (`tf.clip_by_global_norm`, a scale, a logged norm) sees one device's
  gradients, and what `apply_gradients` receives from them is applied once.
  Gradients you compute yourself (`tf.gradients(loss, tvars)`, a
  `GradientTape`) are weighted when they reach `apply_gradients`, once, and
  the ops that changed them on the way read the sums too (see
  `replicate.gradients.touched`); gradients not computed from the tower's
  rows (read back from an accumulator) count once, tower 0's.
  """

  _family = _V1Optimizer

  def __new__(cls, optimizer_or_optimizer_fn=None,
              gradient_transformers=None):
    if cls is TowerOptimizer and _family_of(
        optimizer_or_optimizer_fn) is _KerasOptimizer:
      return KerasTowerOptimizer(optimizer_or_optimizer_fn,
                                 gradient_transformers)
    return super().__new__(cls)

  def __init__(self,
               optimizer_or_optimizer_fn: Union[_V1Optimizer, _KerasOptimizer,
                                                Callable[[], Any]],
               gradient_transformers: Optional[Sequence[Callable]] = None):
    self._init_core(optimizer_or_optimizer_fn, gradient_transformers)
    name = getattr(optimizer_or_optimizer_fn, "get_name", lambda: None)()
    super().__init__(use_locking=False, name=name or "TowerOptimizer")

  def compute_gradients(self, loss, var_list=None, *args, **kwargs):
    """The whole batch's gradients: stand-ins for the sums over towers.

    Weights the loss by this tower's weight, differentiates, and returns
    stand-ins that read the sums over towers once the last tower has made
    this call. With replicated variables, tower i differentiates with
    respect to its own copies of `var_list` (default: the trainable
    variables) and reads the sums on its own device.
    """
    loss = self._weighted_loss(loss)
    variables = apply_once.tower_variables(var_list)
    if not isinstance(variables, list):
      with apply_once.backward_pass():
        return self._whole_batch(self.optimizer.compute_gradients(
            loss, variables, *args, **kwargs))
    return self._whole_batch(self._tower_gradients(
        lambda loss_, variables_: [g for g, _ in self.optimizer.
                                   compute_gradients(loss_, variables_, *args,
                                                     **kwargs)],
        loss, variables))

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Tower 0 builds the one update; every tower's gradients are summed in."""
    def apply(optimizer, grads):
      if not grads:  # every variable is updated by another task
        return _count_step(global_step)
      return optimizer.apply_gradients(grads, global_step, name)

    return self._collect_or_apply(grads_and_vars, apply)

  def get_name(self):
    return self.optimizer.get_name()

  def make_session_run_hook(self, is_chief, num_tokens=-1):
    """The wrapped `SyncReplicasOptimizer`'s hook, closing promptly.

    Its chief otherwise waits 120 s at the end of training for gradients
    that no longer come (see `replicate.cluster.session_hooks.PromptSyncReplicasHook`).
    """
    wrapped = self.optimizer
    if isinstance(wrapped, tf.compat.v1.train.SyncReplicasOptimizer):
      return session_hooks.PromptSyncReplicasHook(wrapped, is_chief, num_tokens)
    return wrapped.make_session_run_hook(is_chief, num_tokens)


class KerasTowerOptimizer(_Core, _KerasOptimizer):
  """`TowerOptimizer` for a Keras legacy optimizer (TF 2 canned estimators).

  Made by `replicate.TowerOptimizer(tf.keras.optimizers.legacy.Adam(...))`.
  `get_updates` (what the canned heads call), `minimize` and
  `apply_gradients` aggregate over towers like `TowerOptimizer`. Setting
  `iterations` to the global step once per tower, as the TF 2 canned
  `model_fn`s do, sets it once.
  """

  _family = _KerasOptimizer

  def __init__(self, optimizer_or_optimizer_fn, gradient_transformers=None):
    self._init_core(optimizer_or_optimizer_fn, gradient_transformers)
    name = _tf.keras_optimizer_name(optimizer_or_optimizer_fn)
    super().__init__(name=name or "TowerOptimizer")

  def get_gradients(self, loss, params):
    return [grad for grad, _ in self._whole_batch(self._tower_gradients(
        self.optimizer.get_gradients, self._weighted_loss(loss),
        list(apply_once.tower_variables(params))))]

  def get_updates(self, loss, params):
    params = list(apply_once.tower_variables(params))  # a replicated tower's copies
    grads = self.get_gradients(loss, params)
    return [self.apply_gradients(list(zip(grads, params)))]

  def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
    with apply_once.backward_pass():
      grads_and_vars = _tf.keras_compute_gradients(
          self.optimizer, self._weighted_loss(loss),
          var_list=apply_once.tower_variables(var_list), grad_loss=grad_loss,
          tape=tape)
    return self.apply_gradients(grads_and_vars, name=name)

  def apply_gradients(self, grads_and_vars, name=None,
                      experimental_aggregate_gradients=True):
    def apply(optimizer, grads):
      if not grads:  # every variable is updated by another task
        return _count_step(optimizer.iterations)
      return optimizer.apply_gradients(
          grads, name=name,
          experimental_aggregate_gradients=experimental_aggregate_gradients)

    return self._collect_or_apply(grads_and_vars, apply)

  @property
  def iterations(self):
    return self.optimizer.iterations

  @iterations.setter
  def iterations(self, variable):
    wrapped = self.optimizer
    if _tf.keras_iterations(wrapped) is not variable:
      wrapped.iterations = variable

  @property
  def weights(self):
    return self.optimizer.weights

  def get_config(self):
    return self.optimizer.get_config()


def _count_step(step) -> tf.Operation:
  """What an update of no variable does: it counts the step, if given one
  (a task of a cluster with ps tasks whose variables all live there)."""
  if step is None:
    return tf.no_op(name="update_elsewhere")
  with tf.compat.v1.colocate_with(step):
    return tf.compat.v1.assign_add(step, 1).op


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
        "returning one. Received: {!r}.{}".format(
            optimizer_or_optimizer_fn,
            apply_once.KERAS_V2_HINT if isinstance(
                optimizer_or_optimizer_fn, tf.keras.optimizers.Optimizer)
            else ""))
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    return _family_of(apply_once.checked(optimizer_or_optimizer_fn(),
                                       (_V1Optimizer, _KerasOptimizer)))
