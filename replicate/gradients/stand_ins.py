"""Stand-ins for values that exist only once every tower is built.

On why: tower 0's `apply_gradients` must return the real update, so that
what the `model_fn` makes wait for it (an `ExponentialMovingAverage` after
the step, a `Saver` that must see the optimizer's slots) waits for the one
update of the step; but the other towers' gradients, whose sum the update
applies, are built after tower 0. Tower 0 therefore builds the update on a
stand-in for each summed gradient, and once the last tower has built the
sum, `connect` makes the stand-in itself compute the sum: whatever reads
it, whenever it was built (an optimizer that keeps the gradients it was
given and builds on them after the `model_fn` returned), reads the sum.
The stand-in is this module's own op; no op the user built is edited. The same
goes for the sum of the towers' loss denominators
(`replicate.loss_denominator`).

On shapes: a stand-in has the shape of what tower 0 had, with dimension 0
left open for the parts of `IndexedSlices` (the towers' slices are
concatenated), so the final value fits wherever the stand-in was read.
"""

from typing import Any

import tensorflow as tf

from replicate import _tf
from replicate.gradients import aggregation
from replicate.shard import rows


def stand_in(value: Any, name: str = "pending") -> Any:
  """A stand-in for a later value shaped like `value` (Tensor or slices).

  `name` is the op's name in the graph ("pending" by default, as before
  the stand-ins had their name: graphs keep their op names).

  Until connected it passes `value` through, so an unconnected stand-in
  still computes something valid.
  """
  if value is None:
    return None
  if isinstance(value, tf.IndexedSlices):
    return tf.IndexedSlices(
        _open_dim0(value.values, name + "_values"),
        _open_dim0(value.indices, name + "_indices"), value.dense_shape)
  value = tf.convert_to_tensor(value)
  return tf.compat.v1.placeholder_with_default(value, value.shape, name=name)


def whole_batch(value: Any, name: str = "whole_batch_gradient") -> Any:
  """A `stand_in` for a sum over towers that is the same in every tower.

  Marked for `replicate.shard.rows`: what is computed from it is not the
  tower's rows (state written from it is written once).
  """
  made = stand_in(value, name)
  if made is not None:
    for tensor in ([made.values, made.indices] if isinstance(
        made, tf.IndexedSlices) else [made]):
      setattr(tensor.op, rows.WHOLE_BATCH, True)
  return made


def connect(standing_in: Any, value: Any) -> None:
  """Makes the stand-in `standing_in` pass `value` on, to every reader."""
  if isinstance(standing_in, tf.IndexedSlices):
    value = aggregation.as_slices(value)
    _pass_on(standing_in.values, value.values)
    _pass_on(standing_in.indices,
             tf.cast(value.indices, standing_in.indices.dtype))
    return
  if isinstance(value, tf.IndexedSlices):
    value = tf.convert_to_tensor(value)
  _pass_on(standing_in, tf.cast(value, standing_in.dtype))


def _open_dim0(tensor, name):
  shape = tensor.shape
  if shape.rank:
    shape = tf.TensorShape([None]).concatenate(shape[1:])
  # Twice: `connect` may only give the stand-in an input whose static shape
  # fits the one it had, so that one must be open too.
  opened = tf.compat.v1.placeholder_with_default(tensor, shape)
  return tf.compat.v1.placeholder_with_default(opened, shape, name=name)


def _pass_on(stand_in: tf.Tensor, value: tf.Tensor) -> None:
  """The stand-in (a `PlaceholderWithDefault`) now defaults to `value`."""
  _tf.update_input(stand_in.op, 0, value)
  stand_in.op.replicate_connected = True  # read by `is_connected`


def is_connected(standing_in: Any) -> bool:
  """Whether `connect` gave the stand-in `standing_in` its value."""
  if isinstance(standing_in, tf.IndexedSlices):
    standing_in = standing_in.values
  return getattr(standing_in.op, "replicate_connected", False)
