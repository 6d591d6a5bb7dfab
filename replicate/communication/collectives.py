"""TensorFlow's collective ops, for the towers' all-reduce and all-gather.

`Collectives(devices, hint)` builds the ops of one `all_reduce_grads` call:
one `CollectiveReduceV2` (or `CollectiveGatherV2`) per tower, on the tower's
device, all with one group key and an instance key of their own. The
`communication_hint` is `"ring"` or `"nccl"`; TensorFlow runs the ring
itself, in C++, instead of as one graph op per hop.

On keys: the group key names the set of devices, the instance key one
reduction over them. Within a graph, every reduction needs its own instance
key (two reductions sharing one abort with "Shape mismatch in the collective
instance", or silently mix values when their shapes agree), and a group key
must always mean the same devices. Both are read from the graph being
built, so nothing is kept between calls or graphs: the next instance key is
one more than the largest any collective op in the graph already has, and
the group key is the one the graph's collective ops on exactly these
devices have, else one more than the largest in use. A second replicated
`model_fn` in the same graph thus gets fresh instance keys, and a rebuilt
graph (the Estimator builds one per train, evaluate and export call) starts
again from 1.

On sessions: a `tf.compat.v1.Session` needs no `ConfigProto` setting for
collectives between its own devices (`experimental.collective_group_leader`
is for multi-worker collectives). Each session resolves groups and
instances on its own: the same keys in two graphs, even in two sessions
open at once over different numbers of devices, do not meet.

On partial runs: a collective op waits for its peers on the other devices.
Each tower's result waits for every tower's op, so fetching one tower's
result runs them all instead of waiting forever for peers never run.

On NCCL: NCCL needs its reductions started in the same order on every GPU,
so with `"nccl"` each collective op waits for the previous one on its
device (TensorFlow's `CollectiveReplicaLauncher` does the same in graph
mode). The ring runs them concurrently.
"""

from typing import Any, List, Optional, Sequence

import tensorflow as tf

# The dtypes CollectiveReduceV2 and CollectiveGatherV2 accept (their op
# definitions refuse others, bfloat16 included).
SUPPORTED_DTYPES = frozenset(
    [tf.float16, tf.float32, tf.float64, tf.int32, tf.int64])


def supports(dtype) -> bool:
  """Whether collective ops can carry tensors of `dtype`."""
  return tf.as_dtype(dtype).base_dtype in SUPPORTED_DTYPES


class Collectives:
  """Collective ops over `devices` in the default graph, with fresh keys."""

  def __init__(self, devices: Sequence[str], communication_hint: str):
    self._devices = list(devices)
    self._hint = communication_hint
    self._group_key, self._next_instance_key = free_keys(
        tf.compat.v1.get_default_graph(), devices)
    self._last_op = [None] * len(devices)  # per device, for NCCL's order

  @property
  def group_key(self) -> int:
    return self._group_key

  def all_reduce(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The sum of `tensors[i]` (on `devices[i]`), on every device."""
    return self._launch(tensors, lambda tensor, keys: tf.raw_ops.
                        CollectiveReduceV2(input=tensor, merge_op="Add",
                                           final_op="Id", **keys))

  def all_gather_slices(self, grads: Sequence[Any]) -> Optional[List[Any]]:
    """Every tower's `IndexedSlices`, concatenated on every device.

    None where collective ops cannot do it: a tower has no gradient, the
    values' dtype is not in `SUPPORTED_DTYPES`, or a tower's values have a
    shape not fully known when building (`.batch()` pipelines: one length
    per step). A collective instance keeps the shapes of its first run, so
    a later step with other lengths aborts with "Shape mismatch in the
    collective instance" (MirroredStrategy's default all-reduce fails so on
    such gradients). CollectiveGatherV2 needs the same shape on every
    device, so known lengths that differ between towers are padded to the
    longest and the padding is dropped after.
    """
    if any(g is None for g in grads) or not supports(grads[0].values.dtype) \
        or not all(g.values.shape.is_fully_defined() for g in grads):
      return None
    values = [g.values for g in grads]
    indices = []
    for grad, device in zip(grads, self._devices):
      with tf.device(device):
        indices.append(tf.cast(grad.indices, tf.int64))
    # dimension_value: under TF 1 behaviour a shape's entries are Dimensions.
    lengths = [tf.compat.dimension_value(v.shape[0]) for v in values]
    if len(set(lengths)) == 1:
      values, indices = self._gather(values), self._gather(indices)
    else:
      values, indices = self._gather_padded(values, indices)
    dense_shape = grads[0].dense_shape
    return [tf.IndexedSlices(v, i, dense_shape)
            for v, i in zip(values, indices)]

  def _gather(self, tensors):
    return self._launch(tensors, lambda tensor, keys: tf.raw_ops.
                        CollectiveGatherV2(input=tensor, **keys))

  def _gather_padded(self, values, indices):
    """Gathers slices of different lengths through equal-length buffers."""
    counts = []
    for index, device in zip(indices, self._devices):
      with tf.device(device):
        counts.append(tf.shape(index)[:1])
    all_counts = self._gather(counts)  # [N] on every device
    padded_values, padded_indices = [], []
    for tower, device in enumerate(self._devices):
      with tf.device(device):
        longest = tf.reduce_max(all_counts[tower])
        padded_values.append(_pad_rows(values[tower], longest))
        padded_indices.append(_pad_rows(indices[tower], longest))
    gathered_values = self._gather(padded_values)
    gathered_indices = self._gather(padded_indices)
    kept_values, kept_indices = [], []
    for tower, device in enumerate(self._devices):
      with tf.device(device):
        longest = tf.reduce_max(all_counts[tower])
        is_real = tf.reshape(
            tf.range(longest)[tf.newaxis, :] < all_counts[tower][:, tf.newaxis],
            [-1])
        kept_values.append(tf.boolean_mask(gathered_values[tower], is_real))
        kept_indices.append(tf.boolean_mask(gathered_indices[tower], is_real))
    return kept_values, kept_indices

  def _launch(self, tensors, make_op):
    """One collective op per tower with a new instance key; joined results."""
    instance_key = self._next_instance_key
    self._next_instance_key += 1
    outputs = []
    for tower, (tensor, device) in enumerate(zip(tensors, self._devices)):
      after = ([self._last_op[tower]]
               if self._hint == "nccl" and self._last_op[tower] else [])
      with tf.device(device):
        # The keys are made before the control dependency, so that it
        # lands on the collective op itself rather than on its key inputs.
        keys = dict(group_size=tf.constant(len(self._devices)),
                    group_key=tf.constant(self._group_key),
                    instance_key=tf.constant(instance_key),
                    communication_hint=self._hint, ordering_token=[])
        with tf.control_dependencies(after):
          output = make_op(tensor, keys)
      self._last_op[tower] = output.op
      outputs.append(output)
    joined = []
    for output, device in zip(outputs, self._devices):
      with tf.device(device), tf.control_dependencies(
          [o.op for o in outputs]):
        joined.append(tf.identity(output))
    return joined


def free_keys(graph: tf.Graph, devices: Sequence[str]):
  """(group key, first free instance key) for a reduction over `devices`."""
  wanted = frozenset(_canonical(d) for d in devices)
  groups = {}  # group key -> the devices of the graph's ops that use it
  largest_instance = 0
  for op in graph.get_operations():
    if not op.type.startswith("Collective"):
      continue
    keys = _keys_of(op)
    if keys is None:
      continue
    groups.setdefault(keys[0], set()).add(_canonical(op.device))
    largest_instance = max(largest_instance, keys[1])
  group_key = next((key for key, on in groups.items() if on == wanted),
                   max(groups, default=0) + 1)
  return group_key, largest_instance + 1


def _keys_of(op):
  """(group key, instance key) of a collective op, or None if not constant.

  Collective V2 ops take the keys as inputs (before any list input, so an
  input's position in the op definition is its position in `op.inputs`);
  V1 ops hold them as attributes.
  """
  names = [arg.name for arg in op.op_def.input_arg]
  if "group_key" in names and "instance_key" in names:
    group = tf.get_static_value(op.inputs[names.index("group_key")])
    instance = tf.get_static_value(op.inputs[names.index("instance_key")])
    if group is None or instance is None:
      return None
    return int(group), int(instance)
  try:
    return op.get_attr("group_key"), op.get_attr("instance_key")
  except ValueError:
    return None  # e.g. CollectiveReduceV3, which has no keys


def _canonical(device):
  return tf.DeviceSpec.from_string(device or "").to_string()


def _pad_rows(tensor, rows):
  """`tensor` with zero rows added at the end up to `rows` rows."""
  missing = rows - tf.shape(tensor)[0]
  paddings = [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1)
  return tf.pad(tensor, paddings)
