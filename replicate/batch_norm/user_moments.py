"""A user's own `tf.nn.moments` over the batch axis, while TRAIN towers are
built; and which moments are replicate's own.

On what: a batch norm written by hand, as older repositories do
(`mean, variance = tf.nn.moments(x, [0])`, then
`tf.nn.batch_normalization(x, mean, variance, offset, scale, epsilon)`),
takes moments over the batch axis. In a tower they would be its shard's,
silently unlike one device. While the towers of a TRAIN call are built
(`replicate.batch_norm.sync_batch_norm.swapped`), `tf.nn.moments` and
`tf.compat.v1.nn.moments` go through `swapped`'s function: moments over
axes that include axis 0, of values computed from the tower's rows, with
several towers, are a synchronized batch-norm site with
`sync_batch_norm=True` (the default): the whole batch's mean and
variance, with exact gradients, as a Keras layer's. With
`sync_batch_norm=False` they are refused with the fix
(`sync_batch_norm.user_moments`). Moments over other axes (layer norm's
last axis) and moments of values not computed from the rows are
TensorFlow's own, and so are moments over axes or of a rank unknown when
the graph is built (whose reductions `replicate.shard.batch_reductions`
then finds, and refuses in TRAIN). In EVAL and PREDICT nothing is swapped:
`replicate.shard.batch_reductions` makes the batch reductions of a user's
moments that flow back into the rows the whole batch's there.

On replicate's own moments: a Keras batch-norm layer's moments (a site, or
per tower with `sync_batch_norm=False`) are built inside `own_moments`:
there `tf.nn.moments` is TensorFlow's own, and the ops built are
replicate's (`progress.own_ops`), which `replicate.shard.batch_reductions`
leaves alone by identity, never by name.
"""

import contextlib
import threading
from typing import Callable

import numpy as np
import tensorflow as tf

_STATE = threading.local()  # depth of `own_moments`


@contextlib.contextmanager
def own_moments(context):
  """Moments built inside are replicate's batch norm's (see the module)."""
  depth = getattr(_STATE, "depth", 0)
  _STATE.depth = depth + 1
  try:
    if context is not None and context.progress.tower_index is not None:
      with context.progress.building_own_ops():
        yield
    else:
      yield
  finally:
    _STATE.depth = depth


def _modules():
  """The API modules users call `moments` through (v1's is its own)."""
  found = []
  for module in (tf.nn, tf.compat.v2.nn, tf.compat.v1.nn):
    if all(module is not other for other in found):
      found.append(module)
  return found


@contextlib.contextmanager
def swapped(over_the_batch: Callable):
  """`tf.nn.moments` over axis 0 is `over_the_batch(original, x, axes,
  keepdims, name)` inside (`axes` non-negative); restored on the way out."""
  modules = _modules()
  originals = [module.moments for module in modules]

  def wrapper(original, is_v1):
    def moments(x, axes, shift=None, *args, **kwargs):
      if is_v1:  # (x, axes, shift, name, keep_dims, keepdims)
        names = ("name", "keep_dims", "keepdims")
      else:  # (x, axes, shift, keepdims, name)
        names = ("keepdims", "name")
      given = dict(zip(names, args), **kwargs)
      call = lambda: original(x, axes, shift, **given)
      if getattr(_STATE, "depth", 0):
        return call()
      keepdims = bool(given.get("keepdims") or given.get("keep_dims"))
      x_tensor = tf.convert_to_tensor(x)
      rank = x_tensor.shape.rank
      static_axes = tf.get_static_value(axes) if tf.is_tensor(axes) else axes
      if static_axes is None or not rank:
        return call()  # unknown axes or rank: TensorFlow's own, see above
      axes_list = [int(axis) % rank for axis in
                   tf.nest.flatten(list(np.ravel(static_axes)))]
      if 0 not in axes_list:
        return call()
      return over_the_batch(call, x_tensor, axes_list, keepdims,
                            given.get("name"))
    return moments

  for module, original in zip(modules, originals):
    module.moments = wrapper(original, module is tf.compat.v1.nn)
  try:
    yield
  finally:
    for module, original in zip(modules, originals):
      module.moments = original
