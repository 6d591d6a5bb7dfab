"""What a tower's `apply_gradients` call is checked for, before it counts.

Each check raises a `ValueError` naming what was wrong and the fix:
- `not_sync_replicas`: no `SyncReplicasOptimizer` in a synchronous cluster;
- `not_in_control_flow`: no call inside a tower's `tf.cond` or `tf.function`;
- `own_copies`: a replicated tower brings gradients for its own copies;
- `same_whole`: the whole batch's gradients are where tower 0's are.
"""

import tensorflow as tf

from replicate import _tf


def not_sync_replicas(context, optimizer):
  """A synchronous cluster needs no `SyncReplicasOptimizer`: refused."""
  if (context.layout.spans_tasks and
      isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer)):
    raise ValueError(
        "TowerOptimizer wraps a SyncReplicasOptimizer, but this RunConfig's "
        "cluster (chief and workers, no ps tasks) trains synchronously "
        "already: every task's towers apply the same sum each step. Wrap "
        "the SyncReplicasOptimizer's own optimizer instead, and drop its "
        "session hook.")


def not_in_control_flow(context):
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


def same_whole(context, tower0_call, whole, grads_and_vars):
  """Tower i's whole-batch gradients are where tower 0's are."""
  if tower0_call.whole == tuple(whole):
    return
  for position, (is_whole, (_, variable)) in enumerate(
      zip(whole, grads_and_vars)):
    if position >= len(tower0_call.whole) or (
        is_whole != tower0_call.whole[position]):
      raise ValueError(
          "Tower {}'s gradient for {!r} is {}computed from what "
          "TowerOptimizer.compute_gradients returned (the whole batch's "
          "gradients), but tower 0's is {}: each tower's model_fn was "
          "supposed to compute its gradients the same way. Make the "
          "gradient code independent of the tower's data.".format(
              context.progress.tower_index, variable.op.name,
              "" if is_whole else "not ", "not" if is_whole else ""))


def own_copies(context, grads_and_vars):
  """A replicated tower must bring gradients for its copies, not tower 0's.

  Its loss was computed from its copies, so a gradient it took with respect
  to tower 0's variable (`tf.gradients(loss, tf.trainable_variables())`) is
  None or wrong; training on it would leave the copies behind unnoticed.
  """
  index = context.progress.tower_index
  if not context.variables.has_copies(index):
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
