"""Which gradients a tower passes to `apply_gradients` still need its weight.

On gradients: `weighted_once` weights each gradient a tower passes to
`apply_gradients` once, however it was made: through `compute_gradients`
or `minimize` (whose loss `replicate.gradients.weighting` weighted) as it
is; computed from the rows some other way (`tf.gradients`, a
`GradientTape`) by the tower's one weight (`TowerWeights.of`); not
computed from the rows, in the first tower only. `whole_batch` says which
gradients are already the whole batch's (computed from the sums over
towers that `compute_gradients` returned), which are applied once.
"""

import tensorflow as tf

from replicate import graph_walk
from replicate.shard import sharding


def whole_batch(context, grads_and_vars: list) -> tuple:
  """Per pair, whether the gradient is already the whole batch's.

  It is when it was computed from what `TowerOptimizer.compute_gradients`
  returned this tower (stand-ins for the sums over towers, see
  `replicate.gradients.apply_once`): clipped, scaled or passed on as it is,
  it is the same in every tower and is applied once, never summed again.
  One computed from those and from the tower's rows too (scaled by a
  value of the tower's rows) is neither, and is refused. (A gradient from
  `tf.gradients` added to it was made the whole batch's already, by
  `replicate.gradients.touched`.)
  """
  index = context.progress.tower_index
  ops = context.records.whole_ops(index)
  if not ops:
    return (False,) * len(grads_and_vars)
  whole = graph_walk.ops_after(ops)
  result = tuple(grad is not None and bool(_ops_of(grad) & whole)
                 for grad, _ in grads_and_vars)
  rows = context.progress.rows_of(index)
  for is_whole, (grad, variable) in zip(result, grads_and_vars):
    if is_whole and rows.depend([grad]):
      raise ValueError(
          "Tower {}'s gradient for {!r} passed to apply_gradients is "
          "computed both from the whole batch's gradients that "
          "TowerOptimizer.compute_gradients returned and from the tower's "
          "own rows (e.g. scaled by a value of the tower's rows), so it "
          "is neither the whole batch's nor the tower's. Fix: compute the "
          "gradients of the total loss in one compute_gradients call, then "
          "change them; or pass the change as TowerOptimizer(..., "
          "gradient_transformers=[...]).".format(index, variable.op.name))
  return result


def weighted_once(context, grads_and_vars: list, whole=()) -> list:
  """The tower's gradients, each weighted by the tower's weight once.

  However the gradients were made: through `compute_gradients` or
  `minimize`, which weighted the loss, they are kept as they are;
  computed from the rows some other way (`tf.gradients(loss, tvars)` as
  BERT does, a `GradientTape`), they are weighted here. A gradient not
  computed from the tower's rows (read back from an accumulator every
  tower added to, a constant) is the same in every tower: tower 0's
  counts, once (in a synchronous cluster, the chief's tower 0's). "From
  the rows" is `replicate.shard.rows`'s rule. A gradient that is already
  the whole batch's (`whole`, see `whole_batch`) is kept as it is.
  """
  index = context.progress.tower_index
  # In a synchronous cluster, the chief's tower 0 is the one tower of all.
  counts_once = context.layout.is_first_task
  weight = context.weights.of(index)
  weighted = graph_walk.ops_after(context.weights.weight_ops(index))
  rows = context.progress.rows_of(index)
  result = []
  whole = tuple(whole) or (False,) * len(grads_and_vars)
  for is_whole, (grad, variable) in zip(whole, grads_and_vars):
    if grad is None or is_whole or _ops_of(grad) & weighted:
      result.append((grad, variable))
    elif rows.depend([grad]):
      context.weights.note_scaled(index)
      result.append((_scaled(grad, weight), variable))
    elif index == 0 and counts_once:
      result.append((grad, variable))
    else:
      result.append((_nothing_like(grad), variable))
  return result


def _ops_of(grad):
  if isinstance(grad, tf.IndexedSlices):
    return {grad.values.op, grad.indices.op}
  return {tf.convert_to_tensor(grad).op}


def _scaled(grad, weight):
  if isinstance(weight, float) and weight == 1.0:
    return grad
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * sharding.weight_as(weight, grad.values.dtype),
                            grad.indices, grad.dense_shape)
  grad = tf.convert_to_tensor(grad)
  return grad * sharding.weight_as(weight, grad.dtype)


def _nothing_like(grad):
  """A gradient that adds nothing to `grad`'s sum over towers."""
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values[:0], grad.indices[:0],
                            grad.dense_shape)
  return tf.zeros_like(grad)
