"""TensorFlow internals replicate reads, kept in one place.

Each is pinned by `tests/test_tf_internals.py` to its TensorFlow 2.15
behaviour.
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Set

import tensorflow as tf
from tensorflow.python.framework import op_def_registry
from tensorflow.python.ops import nn as _nn
from tensorflow.python.ops import nn_impl as _nn_impl
from keras.src.layers.normalization import batch_normalization as _keras_bn

# Attributes of the call ops that name the functions they run.
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "cond", "body",
                   "branches")


def is_stateful(op: tf.Operation) -> bool:
  """Whether TensorFlow registers `op`'s type as stateful."""
  return op.op_def.is_stateful


def called_functions(op: tf.Operation) -> Optional[Set[str]]:
  """The op types of every function `op` calls, nested calls included.

  None when `op` calls no function (it is no `PartitionedCall`, `If`,
  `While`, `Case`, ...). Only the stateful types are returned.
  """
  names = _function_names(op.node_def.attr)
  if not names:
    return None
  found = set()
  seen = set()
  while names:
    name = names.pop()
    if name in seen:
      continue
    seen.add(name)
    function = op.graph._get_function(name)  # pylint: disable=protected-access
    if function is None:
      found.add("<unknown function {}>".format(name))
      continue
    for node in function.definition.node_def:
      op_def = op_def_registry.get(node.op)
      if op_def is not None and op_def.is_stateful:
        found.add(node.op)
      names.extend(_function_names(node.attr))
  return found


def _function_names(attrs):
  names = []
  for key in _FUNCTION_ATTRS:
    if key not in attrs:
      continue
    value = attrs[key]
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  return names


# The modules whose `fused_batch_norm` Keras's fused layers reach: it calls
# `tf.compat.v1.nn.fused_batch_norm`, looked up when the layer is called.
_FUSED_BATCH_NORM_HOLDERS = (tf.compat.v1.nn, _nn, _nn_impl)


@contextlib.contextmanager
def batch_norm_swapped(calculate_mean_and_var: Callable,
                       fused_batch_norm: Callable):
  """Keras's batch-norm moments and the fused op go through the given ones.

  Inside, Keras's `BatchNormalizationBase._calculate_mean_and_var` (every
  non-fused training call, `synchronized=True` layers included) is
  `calculate_mean_and_var(original, layer, inputs, reduction_axes,
  keep_dims, mask)`, and `tf.compat.v1.nn.fused_batch_norm` (every fused
  layer) is `fused_batch_norm(original, *args, **kwargs)`. Both are
  restored on the way out. They are process-wide while inside, so the given
  functions must call the original for any graph they do not build.
  """
  base = _keras_bn.BatchNormalizationBase
  original_moments = base.__dict__["_calculate_mean_and_var"]
  original_fused = tf.compat.v1.nn.fused_batch_norm

  def moments(layer, inputs, reduction_axes, keep_dims, mask=None):
    return calculate_mean_and_var(original_moments, layer, inputs,
                                  reduction_axes, keep_dims, mask)

  def fused(*args, **kwargs):
    return fused_batch_norm(original_fused, *args, **kwargs)

  base._calculate_mean_and_var = moments  # pylint: disable=protected-access
  for module in _FUSED_BATCH_NORM_HOLDERS:
    module.fused_batch_norm = fused
  try:
    yield
  finally:
    base._calculate_mean_and_var = original_moments  # pylint: disable=protected-access
    for module in _FUSED_BATCH_NORM_HOLDERS:
      module.fused_batch_norm = original_fused


def enclosing_graphs(graph) -> Iterator[tf.Graph]:
  """`graph`, then the graphs it is built in (a function graph's outer ones)."""
  while graph is not None:
    yield graph
    graph = getattr(graph, "outer_graph", None)


def in_control_flow(graph) -> bool:
  """Whether ops built now go inside a TF 1 `cond` or `while_loop`."""
  return graph._get_control_flow_context() is not None  # pylint: disable=protected-access


def outer_tensors(tensor: tf.Tensor, graph) -> Optional[List[tf.Tensor]]:
  """The tensors of `graph` a tensor of a function graph inside it reads.

  `[tensor]` when it is `graph`'s own. A function's captures (what a
  `tf.cond` branch reads from outside) map back to the outer tensors; None
  when it reads a function's arguments, which only the call site knows.
  """
  if tensor.graph is graph:
    return [tensor]
  inner = tensor.graph
  captured = {internal.ref(): external
              for external, internal in getattr(inner, "captures", ())}
  found = []
  seen = set()
  pending = [tensor.op]
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type == "Placeholder":
      external = captured.get(op.outputs[0].ref())
      outer = None if external is None else outer_tensors(external, graph)
      if outer is None:
        return None
      found.extend(outer)
    pending.extend(t.op for t in op.inputs)
  return found
