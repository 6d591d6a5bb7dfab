"""`sync_batch_norm` (default True): batch norm in training mode on the whole
batch's moments.

On where: while TRAIN towers are built, `replicate._tf.batch_norm_swapped`
sends every training-mode moments call of a Keras batch norm
(`tf.keras.layers.BatchNormalization` and `tf.compat.v1.layers`, non-fused)
to `calculate_mean_and_var`, and every `fused_batch_norm(is_training=True)`
to `fused_batch_norm`, and a user's own `tf.nn.moments` over the batch
axis to `user_moments` (see `replicate.batch_norm.user_moments`: a site, or
refused with `sync_batch_norm=False`). With `sync_batch_norm=True` each
becomes a site (see
`replicate.batch_norm.batch_norm_sites`); a Keras layer declared `synchronized=True` is
one whatever the flag. With `sync_batch_norm=False` the others stay per
tower, and tower 0 records their names for the call's INFO line
(`replicate.towers.report`). Anything else (one tower, EVAL and PREDICT, a
layer whose input is not computed from the tower's rows, such as Keras's
construction call on `tf.keras.Input`) calls TensorFlow's own; a model
without batch norm never reaches this module, so the default builds the
same graph for it as `sync_batch_norm=False`.

On moving statistics: with sync every tower's moving-average write is the
whole batch's; `replicate.state.train_op` still combines the towers' writes by
their shares n_i / n, as for any statistic, which returns the batch's (to
the rounding of the shares: exact Python numbers for a batch of known size,
float32 otherwise). One rule for every statistic, and a tower on a stand-in
row still weighs 0.

On what cannot be synchronized: a training-mode batch norm inside a nested
graph (a `tf.cond`, as Keras builds a fused layer whose `training` is a
tensor, or a `tf.function`), a Keras mask, `virtual_batch_size`, and a
ps cluster of several training tasks are refused with the fix, never left
per-tower in silence; so is a gradient through a site not made by
`TowerOptimizer` (see `replicate.batch_norm.batch_norm_sites`), a gradient penalty's
`tf.gradients` included. With the default these refusals reach users who
never asked for synchronization; they stay refusals, each naming the layer
and `sync_batch_norm=False` among the fixes, because the alternative is a
step unlike one device's in silence. Each is raised only at a batch norm in
training mode, so a model without one is never refused. A batch norm built
outside a `tf.cond` and picked by it (DeepFM's training and inference
branches) is synchronized, not refused.
"""

import contextlib
from typing import Callable

import tensorflow as tf

from replicate.batch_norm import batch_moments
from replicate.batch_norm import batch_norm_sites
from replicate.batch_norm import user_moments as user_moments_lib
from replicate.cluster import ps_cluster
from replicate.call import layout as layout_lib
from replicate import _tf


def check_cluster(sync_all: bool, config, mode: str) -> Callable:
  """What makes a call's `BatchNormSync` from its layout (None: none).

  Only TRAIN synchronizes. In a synchronous cluster (with ps tasks too,
  `"replicated"`) the moments and their gradients are combined across
  tasks too. In a ps cluster of several training tasks, whose workers step
  on their own, a batch norm that would be synchronized (every one with
  `sync_batch_norm=True`, the default; else a layer declared
  `synchronized=True`) is refused where it is built, naming the layer: a
  model without batch norm trains there with the default.
  """
  if mode != tf.estimator.ModeKeys.TRAIN:
    return lambda layout: None
  tasks = ps_cluster.num_training_tasks(config)
  refusal = None
  if tasks > 1:
    refusal = (
        "The batch norm {{}} {}, but this RunConfig's cluster has {} "
        "training tasks (chief and workers) and ps tasks, where each worker "
        "steps on its own: batch-norm moments can be combined over one "
        "task's towers only. Fix: {} (each tower normalizes with its own "
        "rows), or a synchronous cluster (variable_strategy='replicated' "
        "and replicate.start_server, with or without ps tasks).".format(*(
            ("is synchronized by sync_batch_norm=True (the default)", tasks,
             "sync_batch_norm=False") if sync_all else
            ("is declared synchronized=True", tasks, "synchronized=False"))))
  # A cluster whose tasks step together (`layout.spans_tasks`) combines
  # the moments across tasks.
  return lambda layout: batch_norm_sites.BatchNormSync(
      layout.num_towers, layout.has_rows, sync_all,
      None if layout.spans_tasks else refusal, layout.cross_task)


def swapped(context):
  """While the towers are built, batch norm goes through this module, and
  a user's own `tf.nn.moments` over the batch axis too
  (`replicate.batch_norm.user_moments`)."""
  if context.batch_norm is None:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  stack.enter_context(_tf.batch_norm_swapped(calculate_mean_and_var,
                                             fused_batch_norm))
  stack.enter_context(user_moments_lib.swapped(user_moments))
  return stack


def user_moments(original, x, axes, keep_dims, name):
  """A user's `tf.nn.moments(x, axes)` over the batch axis, at a site.

  With `sync_batch_norm=False` refused: the moments would be the shard's.
  """
  context = batch_norm_sites.outer_context()
  if (context is None or context.progress.tower_index is None or
      not context.layout.combines or context.batch_norm is None or
      not _from_rows(context, x)):
    return original()
  label = repr(layout_lib.to_tower0_name(tf.compat.v1.get_default_graph(
      ).unique_name(name or "moments", mark_as_used=False),
                                         context.progress.tower_index))
  if not context.batch_norm.sync_all:
    raise ValueError(
        "The moments {} (tf.nn.moments over axes {}, which include the "
        "batch axis) would be each tower's own shard's with "
        "sync_batch_norm=False, so the values normalized with them would "
        "not be one device's. Fix: sync_batch_norm=True (the default), "
        "which makes them the whole batch's, with exact gradients; or take "
        "the moments of replicate.all_rows(x).".format(label, axes))
  _check_not_nested(context, label)
  with tf.name_scope(name or "moments"), user_moments_lib.own_moments(
      context):
    mean, variance = batch_moments.local_moments(x, axes, keep_dims)
    _, mean, variance = context.batch_norm.synced(context, label, x, axes,
                                                  mean, variance)
  return mean, variance


def calculate_mean_and_var(original, layer, inputs, reduction_axes,
                           keep_dims, mask=None):
  """Keras `_calculate_mean_and_var`, on the whole batch at a site; its
  moments are replicate's own, synchronized or not."""
  with user_moments_lib.own_moments(batch_norm_sites.outer_context()):
    return _layer_moments(original, layer, inputs, reduction_axes,
                          keep_dims, mask)


def _layer_moments(original, layer, inputs, reduction_axes, keep_dims,
                   mask):
  call_original = lambda: original(layer, inputs, reduction_axes, keep_dims,
                                   mask=mask)
  if 0 not in reduction_axes:
    return call_original()  # not a batch's moments
  active = _active(bool(getattr(layer, "synchronized", False)),
                   lambda: repr(_variables_scope(layer)), inputs)
  if active is None:
    return call_original()  # one tower, per tower, or not from the rows
  context, batch_norm = active
  label = repr(layer.name)
  _check_not_nested(context, label)
  if mask is not None:
    raise _cannot_sync(label, "is called with a mask (Keras masking)",
                       "drop the mask (mask=None), or use a non-batch "
                       "normalization")
  if getattr(layer, "virtual_batch_size", None) is not None:
    raise _cannot_sync(label, "has virtual_batch_size={}".format(
        layer.virtual_batch_size), "remove virtual_batch_size")
  mean, variance = batch_moments.local_moments(inputs, reduction_axes,
                                               keep_dims)
  _, mean, variance = batch_norm.synced(context, label, inputs,
                                        reduction_axes, mean, variance)
  return mean, variance


def fused_batch_norm(original, x, scale, offset, mean=None, variance=None,
                     epsilon=0.001, data_format="NHWC", is_training=True,
                     name=None, exponential_avg_factor=1.0):
  """`tf.compat.v1.nn.fused_batch_norm`, on the whole batch at a site.

  Returns what the kernel returns in training mode: y, the batch mean and
  the batch's unbiased variance (Keras moves a fused layer's moving
  variance towards that one).
  """
  with user_moments_lib.own_moments(batch_norm_sites.outer_context()):
    return _fused(original, x, scale, offset, mean, variance, epsilon,
                  data_format, is_training, name, exponential_avg_factor)


def _fused(original, x, scale, offset, mean, variance, epsilon,
           data_format, is_training, name, exponential_avg_factor):
  active = _active(False, lambda: repr(_scope_name(
      batch_norm_sites.outer_context())), x) if is_training else None
  if active is None:
    return original(x, scale, offset, mean=mean, variance=variance,
                    epsilon=epsilon, data_format=data_format,
                    is_training=is_training, name=name,
                    exponential_avg_factor=exponential_avg_factor)
  context, batch_norm = active
  label = repr(_scope_name(context))
  _check_not_nested(context, label)
  if exponential_avg_factor not in (None, 1.0):
    raise _cannot_sync(label, "is given exponential_avg_factor={}".format(
        exponential_avg_factor), "leave exponential_avg_factor at 1.0")
  x = tf.convert_to_tensor(x)
  scale = tf.convert_to_tensor(scale)
  offset = tf.convert_to_tensor(offset)
  channel = 1 if data_format.startswith("NC") else x.shape.rank - 1
  axes = [axis for axis in range(x.shape.rank) if axis != channel]
  local_mean, local_variance = batch_moments.local_moments(
      tf.cast(x, scale.dtype), axes, keepdims=False)
  count, batch_mean, batch_variance = batch_norm.synced(
      context, label, x, axes, local_mean, local_variance)
  y = batch_moments.normalized(original, x, scale, offset, batch_mean,
                               batch_variance, epsilon, data_format)
  return y, batch_mean, batch_moments.unbiased(batch_variance, count)


def _active(is_declared, label, inputs):
  """(context, its BatchNormSync) while a site is to be made, else None.

  None for one tower, outside a TRAIN build, for inputs not computed from
  the tower's rows, and for a layer left per tower (`sync_batch_norm=False`
  and not declared `synchronized=True`), whose `label()` tower 0 records
  for the call's INFO line.
  """
  context = batch_norm_sites.outer_context()
  if (context is None or context.progress.tower_index is None or
      not context.layout.combines or context.batch_norm is None or
      not _from_rows(context, inputs)):
    return None
  if not (context.batch_norm.sync_all or is_declared):
    if context.progress.tower_index == 0:
      context.batch_norm.per_tower(label())
    return None
  return context, context.batch_norm


def _variables_scope(layer):
  """Where a layer's variables are (`bn_0/batch_normalization`), as its
  checkpoint names them; else its name."""
  moving_mean = getattr(layer, "moving_mean", None)
  name = getattr(moving_mean, "name", "")
  if name.endswith("/moving_mean:0"):
    return name[:-len("/moving_mean:0")]
  return layer.name


def _scope_name(context):
  """Tower 0's name scope of the call: the layer's, for a Keras layer.

  A function graph (a `tf.cond` branch) starts its own scopes; its call's
  scope in the graph around it is the layer's.
  """
  for graph in _tf.enclosing_graphs(tf.compat.v1.get_default_graph()):
    scope = graph.get_name_scope()
    if scope:
      return layout_lib.to_tower0_name(scope, context.progress.tower_index)
  return ""


def _from_rows(context, tensor):
  """Whether `tensor` is computed from the tower's rows (unknown: yes)."""
  outer = _tf.outer_tensors(tensor, context.layout.graph)
  progress = context.progress
  return outer is None or progress.rows_of(progress.tower_index).depend(outer)


def _check_not_nested(context, label):
  graph = tf.compat.v1.get_default_graph()
  if graph is context.layout.graph and not _tf.in_control_flow(graph):
    return
  raise _cannot_sync(label, (
      "runs in training mode inside a tf.cond, a while loop or a tf.function "
      "(Keras builds it inside a tf.cond when its training argument is a "
      "tensor), where its moments cannot meet the other towers'"), (
          "pass training as a Python bool (e.g. training=(mode == "
          "tf.estimator.ModeKeys.TRAIN)) and call the layer outside "
          "tf.function"))


def _cannot_sync(label, why, fix):
  return ValueError(
      "The batch norm {} {}, so replicate_model_fn cannot normalize it with "
      "the whole batch's moments (sync_batch_norm=True, or a Keras layer "
      "declared synchronized=True). Fix: {}; or, for per-tower batch norm, "
      "sync_batch_norm=False and synchronized=False.".format(label, why, fix))


