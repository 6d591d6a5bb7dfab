"""TensorFlow's private parts replicate uses, all of them, in one place.

No other module of the package imports `tensorflow.python`, `keras.src` or
reads a private attribute of a TensorFlow object: each use is a small named
function here, with one line saying why no public API does it, and is
pinned by `tests/test_tf_internals.py` to its TensorFlow 2.15 behaviour
(`tests/test_layout.py` checks that nothing outside this module reaches
for them).

Grouped by what they are for:
- the supported TensorFlow (checked when a public name of `replicate` is
  first used, which imports TensorFlow);
- the Estimator: how it calls a `model_fn`, its export, canned heads;
- devices: the session's devices, placing an op after the fact;
- editing built ops: inputs, control inputs, TF 1 control flow;
- graph collections and name counters (what each tower sees and is named);
- Keras legacy optimizers;
- function graphs (tf.function, TF 2 control flow) and stateful ops;
- batch norm (synchronized batch norm's swaps).
"""

import contextlib
import inspect
import sys
from typing import Any, Callable, Iterator, List, Optional, Set, Tuple

import tensorflow as tf

# Raises ImportError, with the fix, if the package `replicate` was imported
# from an install whose `__init__.py` the Replicate.com client replaced.
from replicate import _identity  # noqa: F401,E402  pylint: disable=unused-import

# The supported TensorFlow --------------------------------------------------

SUPPORTED_TENSORFLOW = "2.15"


def check_tensorflow_version(version: str) -> None:
  """Raises ImportError unless `version` is a TensorFlow 2.15.x.

  2.15 is the last release with `tf.estimator`; the private parts below are
  pinned to it.
  """
  if version.split(".")[:2] == SUPPORTED_TENSORFLOW.split("."):
    return
  raise ImportError(
      "replicate needs TensorFlow {supported}.x (the last release with "
      "tf.estimator), but TensorFlow {version} is installed. Fix: on Python "
      "3.11, pip install \"tensorflow-cpu=={supported}.*\" "
      "\"tensorflow-estimator=={supported}.*\" (or, for GPUs, "
      "\"tensorflow[and-cuda]=={supported}.*\").".format(
          supported=SUPPORTED_TENSORFLOW, version=version))


# Before the private imports below, which may fail on another TensorFlow.
check_tensorflow_version(tf.__version__)

# pylint: disable=wrong-import-position,protected-access
from keras.src import backend as _keras_backend  # noqa: E402
from keras.src.layers.normalization import batch_normalization as _keras_bn  # noqa: E402
from tensorflow.python.client import device_lib as _device_lib  # noqa: E402
from tensorflow.python.framework import op_def_registry as _op_def_registry  # noqa: E402
from tensorflow.python.ops import nn as _nn  # noqa: E402
from tensorflow.python.ops import nn_impl as _nn_impl  # noqa: E402
from tensorflow.python.ops import variable_scope as _variable_scope  # noqa: E402
from tensorflow.python.util import function_utils as _function_utils  # noqa: E402


# The Estimator ---------------------------------------------------------------


def fn_args(fn: Callable) -> Tuple[str, ...]:
  """The argument names the Estimator sees in `fn` (partials, callables).

  Private: the Estimator decides what to pass a `model_fn` with this very
  function, and the wrapper must decide the same.
  """
  return _function_utils.fn_args(fn)


def in_saved_model_export() -> bool:
  """Whether the Estimator's SavedModel export is among the callers.

  Private: the Estimator tells a `model_fn` nothing about exporting; its
  export method, `_add_meta_graph_for_mode`, is recognised on the stack.
  """
  exporting = tf.estimator.Estimator._add_meta_graph_for_mode.__code__
  frame = inspect.currentframe()
  while frame is not None:
    if frame.f_code is exporting:
      return True
    frame = frame.f_back
  return False


def estimator_model_fn(estimator) -> Optional[Callable]:
  """The `model_fn` a (canned) estimator was built with, or None.

  Private: the public `estimator.model_fn` wraps it, with no closure.
  """
  return getattr(estimator, "_model_fn", None)


def is_head(value: Any) -> bool:
  """Whether `value` looks like a canned estimator's head (v1 or v2)."""
  return hasattr(value, "loss_reduction") or hasattr(value, "_loss_reduction")


def head_loss_reduction(head) -> Any:
  """How a canned head reduces its loss.

  Private for v1 heads: only the v2 heads have a public `loss_reduction`.
  """
  return getattr(head, "loss_reduction", None) or getattr(
      head, "_loss_reduction")


def head_weight_column(head) -> Any:
  """A canned head's `weight_column`, or None. Private: no head exposes it."""
  return getattr(head, "_weight_column", None)


# Devices ---------------------------------------------------------------------


def list_local_devices(session_config=None) -> list:
  """The local devices (`DeviceAttributes`) a session with this config has.

  Private: `tf.config.list_logical_devices` reports the eager context's
  devices, and cannot count with a session's `device_count`.
  """
  return _device_lib.list_local_devices(session_config)


def set_device(op: tf.Operation, device: str) -> None:
  """Places an op that is already built.

  Private: device functions see an op only when it is made; an op made
  under `colocate_with(None)` never meets one.
  """
  op._set_device(device)


def set_colocation_group(op: tf.Operation, group: str) -> None:
  """Puts `op` in the colocation group `group` (its `_class` attribute).

  Private: colocation is set only by `colocate_with` while an op is made;
  an op's own group is otherwise its name.
  """
  op._set_attr("_class", tf.compat.v1.AttrValue(  # pylint: disable=protected-access
      list=tf.compat.v1.AttrValue.ListValue(s=[b"loc:@" + group.encode()])))


def built_colocated(op: tf.Operation) -> bool:
  """Whether `op` was built under `colocate_with`, known without reading its
  attributes (which costs a failed look-up for every other op).

  Private: the graph notes where each op's colocation came from.
  """
  return bool(getattr(op, "_colocation_code_locations", None))


def colocation_ops(graph) -> list:
  """The ops what is built now is colocated with (`colocate_with`).

  Private: the graph keeps its colocation stack unexposed.
  """
  return list(graph._colocation_stack.peek_objs())


# Editing built ops -----------------------------------------------------------


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
  """`op` now reads `tensor` as its input `index`, in every later run.

  Private: TensorFlow has no public way to rewire a built op, and the
  op's readers were built before the value existed (see
  `replicate.gradients.stand_ins`).
  """
  op._update_input(index, tensor)


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
  """`op` now runs after `control`.

  Private: `tf.control_dependencies` only reaches ops not yet built.
  """
  op._add_control_input(control)


def copy_op(op: tf.Operation, inputs: List[tf.Tensor],
            control_inputs: List[tf.Operation], name: str) -> tf.Operation:
  """A new op of `op`'s type and attributes, on `op`'s device, reading
  `inputs` (after `control_inputs`); its shapes are inferred from them.

  Private: TensorFlow builds ops from Python functions, not from another
  op; `Graph._create_op_internal` is what `tf.raw_ops` calls reach.
  """
  graph = op.graph
  attrs = {key: value for key, value in op.node_def.attr.items()}
  copy = graph._create_op_internal(
      op.type, inputs, dtypes=[t.dtype for t in op.outputs], name=name,
      attrs=attrs, op_def=op.op_def, compute_device=False)
  copy._set_device(op.device)
  if control_inputs:
    copy._add_control_inputs(control_inputs)
  return copy


def is_ref_dtype(dtype: tf.DType) -> bool:
  """Whether `dtype` is a TF 1 reference (a `tf.Variable`'s, read as a ref).

  Private: `DType._is_ref_dtype` is the only test TensorFlow has.
  """
  return dtype._is_ref_dtype


def in_control_flow(graph) -> bool:
  """Whether ops built now go inside a TF 1 `cond` or `while_loop`.

  Private: TF 1 control flow keeps its context on the graph, unexposed.
  """
  return graph._get_control_flow_context() is not None


def built_in_control_flow(op: tf.Operation) -> bool:
  """Whether `op` was built inside a TF 1 `cond` or `while_loop`.

  Private: the op's TF 1 control-flow context is not exposed.
  """
  return op._control_flow_context is not None


# Graph collections and name counters ------------------------------------------


def replace_collection(graph, key: str, values: list) -> None:
  """`graph.get_collection(key)` is now `values`, this very list object.

  Private: `get_collection_ref` gives the graph's own list, which can be
  emptied and refilled but not replaced by a list that ignores additions
  (towers 1..N-1's regularization losses, see
  `replicate.towers.tower_collections`).
  """
  graph._collections[key] = values


NameCounts = Tuple[dict, dict]


def name_counts(graph) -> NameCounts:
  """A snapshot of the counters that make default names unique in `graph`.

  Variable scopes' counts (`variable_scope(None, default_name=...)`) and
  Keras's layer-name uids (unnamed layers). Private: TensorFlow keeps them
  in a variable-scope store and a Keras backend map, with no public API.
  """
  with graph.as_default():
    return (dict(_variable_scope.get_variable_scope_store()
                 .variable_scopes_count),
            dict(_keras_backend.get_default_graph_uid_map()))


def restore_name_counts(graph, counts: NameCounts) -> None:
  """Sets `graph`'s default-name counters back to a `name_counts` snapshot."""
  scopes, layers = counts
  with graph.as_default():
    _variable_scope.get_variable_scope_store().variable_scopes_count = dict(
        scopes)
    layer_uids = _keras_backend.get_default_graph_uid_map()
    layer_uids.clear()
    layer_uids.update(layers)


def release_name(graph, op_name: str) -> None:
  """`graph.unique_name(op_name)` hands out `op_name` again, though used.

  Private: the graph's names in use are not exposed; `unique_name` only
  ever adds to them.
  """
  graph._names_in_use.pop(op_name.lower(), None)


def take_name(graph, op_name: str) -> None:
  """Marks `op_name` as used again (see `release_name`)."""
  graph._names_in_use[op_name.lower()] = max(
      1, graph._names_in_use.get(op_name.lower(), 0))


# Keras legacy optimizers ------------------------------------------------------


def keras_compute_gradients(optimizer, loss, var_list, grad_loss=None,
                            tape=None) -> list:
  """A Keras legacy optimizer's `minimize` up to its gradients, not applied.

  Private: the public `get_gradients` takes no `grad_loss` or `tape`, and
  `minimize` applies.
  """
  return optimizer._compute_gradients(loss, var_list=var_list,
                                      grad_loss=grad_loss, tape=tape)


def keras_iterations(optimizer) -> Optional[tf.Variable]:
  """A Keras legacy optimizer's `iterations` variable, None if not made yet.

  Private: the public `iterations` makes the variable when there is none.
  """
  return optimizer._iterations


def keras_optimizer_name(optimizer) -> Optional[str]:
  """A Keras legacy optimizer's name, or None for anything else.

  Private: legacy optimizers expose it only through `get_config()`, which
  also reads every hyperparameter's value.
  """
  return getattr(optimizer, "_name", None)


# Hooks and summaries ----------------------------------------------------------

# The graph collections of summaries: v1's, TF 2's write ops and TF 2's
# writer initializers (`ops.GraphKeys._SUMMARY_COLLECTION`, read by
# `tf.compat.v1.summary.all_v2_summary_ops()`, and summary_ops_v2's
# `_SUMMARY_WRITER_INIT_COLLECTION_NAME`, by `tf.compat.v1.summary.
# initialize()`). Private: the last two have no public name.
SUMMARY_COLLECTIONS = ("summaries", "_SUMMARY_V2", "_SUMMARY_WRITER_V2")



def logging_hook_tensors(hook) -> dict:
  """A `LoggingTensorHook`'s {tag: tensor or tensor name}, as given.

  Private: the hook keeps them unexposed, and resolves names in `begin`.
  """
  return dict(hook._tensors)


def set_logging_hook_tensors(hook, tensors: dict) -> None:
  """The hook logs `tensors` ({tag: tensor}, its tags) from its next
  `begin` on.

  Private: as `logging_hook_tensors`.
  """
  hook._tensors = tensors


# Function graphs and stateful ops ---------------------------------------------

# Attributes of the call ops that name the functions they run.
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "cond", "body",
                   "branches")


def is_stateful(op: tf.Operation) -> bool:
  """Whether TensorFlow registers `op`'s type as stateful."""
  return op.op_def.is_stateful


def called_functions(op: tf.Operation) -> Optional[Set[str]]:
  """The op types of every function `op` calls, nested calls included.

  None when `op` calls no function (it is no `PartitionedCall`, `If`,
  `While`, `Case`, ...). Only the stateful types are returned. Private: a
  graph's functions and the registry of op definitions are not exposed in
  graph mode.
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
    function = op.graph._get_function(name)
    if function is None:
      found.add("<unknown function {}>".format(name))
      continue
    for node in function.definition.node_def:
      op_def = _op_def_registry.get(node.op)
      if op_def is not None and op_def.is_stateful:
        found.add(node.op)
      names.extend(_function_names(node.attr))
  return found


def function_graph(op: tf.Operation, attr: str):
  """The `FuncGraph` of the function `op`'s `attr` names (a TF 2 `While`'s
  "body"), or None when this process did not build it. Private: a graph's
  functions are not exposed in graph mode."""
  try:
    name = op.get_attr(attr).name
  except (ValueError, AttributeError):
    return None
  function = op.graph._get_function(name)
  return getattr(function, "graph", None)


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


def enclosing_graphs(graph) -> Iterator[tf.Graph]:
  """`graph`, then the graphs it is built in (a function graph's outer ones)."""
  while graph is not None:
    yield graph
    graph = getattr(graph, "outer_graph", None)


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


# Batch norm -------------------------------------------------------------------

def _is_layer_normalization(frame) -> bool:
  """Whether the fused batch norm is called by Keras's `LayerNormalization`.

  Keras computes a layer norm with the fused batch-norm kernel on a
  `[1, rows x ..., width, 1]` reshape of its input: each row's own
  statistics, nothing to combine across towers.
  """
  return isinstance(frame.f_locals.get("self"),
                    tf.keras.layers.LayerNormalization)


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
  Private: Keras has no hook for a layer's moments, and the fused op is
  looked up in TensorFlow's own modules.
  """
  base = _keras_bn.BatchNormalizationBase
  original_moments = base.__dict__["_calculate_mean_and_var"]
  original_fused = tf.compat.v1.nn.fused_batch_norm

  def moments(layer, inputs, reduction_axes, keep_dims, mask=None):
    return calculate_mean_and_var(original_moments, layer, inputs,
                                  reduction_axes, keep_dims, mask)

  def fused(*args, **kwargs):
    if _is_layer_normalization(sys._getframe(1)):  # pylint: disable=protected-access
      return original_fused(*args, **kwargs)
    return fused_batch_norm(original_fused, *args, **kwargs)

  base._calculate_mean_and_var = moments
  for module in _FUSED_BATCH_NORM_HOLDERS:
    module.fused_batch_norm = fused
  try:
    yield
  finally:
    base._calculate_mean_and_var = original_moments
    for module in _FUSED_BATCH_NORM_HOLDERS:
      module.fused_batch_norm = original_fused
