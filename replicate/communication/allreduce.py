"""All-reduce of the towers' gradients, for `variable_strategy="replicated"`.

Every tower holds its own copy of each variable, so every tower needs the
sum of all towers' gradients on its own device. Given tower i's gradients on
`devices[i]`, `all_reduce_grads` returns, for every tower, the sums placed
on that tower's device.

On algorithms (the `all_reduce` argument of `replicate_model_fn`):

| name     | how                                                          |
| -------- | ------------------------------------------------------------ |
| `gather` | sum on tower 0's device, then copy the sum to every tower    |
| `ring`   | TensorFlow's collective all-reduce (`CollectiveReduceV2`,    |
|          | `communication_hint="ring"`): one op per tower, on its       |
|          | device; the ring runs inside TensorFlow's runtime            |
| `nccl`   | the same op with `communication_hint="nccl"` (GPU towers,    |
|          | TensorFlow with CUDA)                                        |
| `auto`   | `nccl` on GPUs when TensorFlow has it, else `gather`         |

See `replicate.communication.collectives` for keys and sessions: a session
needs no configuration for `ring`.

On the benchmarks' seam: `gather_reduce_replaced(reduce)` swaps the dense
sum of `gather` while inside, which is how `benchmarks/hand_ring.py` builds
the ring this module built before `ring` used collective ops
(`replicate-N-handring`). It is no API and no `all_reduce` value.

On sparse gradients (`IndexedSlices`, from embedding lookups): every tower
gets every tower's slices, concatenated (an all-gather), never a dense sum,
however small the variable: the update must touch only the rows the batch
looked up, as on one device (a momentum or Adagrad update of a row the
batch did not see would move it, and a global norm of a dense sum is not
the norm of the slices). Across the tasks of a synchronous cluster the
slices are all-gathered too, lengths first (see `_slices_over_tasks`):
what travels grows with the rows looked up, not the table. With `ring` and
`nccl` the all-gather is
`CollectiveGatherV2` (slices of different lengths padded to the longest);
with `gather`, or where collective ops cannot carry the slices (a tower
without a gradient, a dtype such as bfloat16, or a length known only at
run time, as every `.batch()` pipeline gives: a collective instance keeps
the shapes of its first step and aborts on the next step's other length),
each tower concatenates the others' slices itself. Dense gradients of such
a dtype or shape are summed as with `gather`.

On packing: dense gradients of at most `PACK_MAX_ELEMENTS` elements each are
flattened and concatenated per dtype into one buffer per tower before the
reduce and split after, so a model with many small variables makes one
all-reduce instead of one per variable.

On `compact`: dense float32 gradients are cast to float16 for the reduce
and back after, halving what travels between devices, at float16's
precision and range: a summed gradient beyond 65504 becomes inf (which a
loss-scale optimizer turns into a skipped step). Gathered sparse slices
travel as they are.
"""

import contextlib
import functools
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from replicate.communication import collectives

AUTO = "auto"
GATHER = "gather"
RING = "ring"
NCCL = "nccl"
ALGORITHMS = (AUTO, GATHER, RING, NCCL)

PACK_MAX_ELEMENTS = 32768


def check_algorithm(all_reduce: str):
  """Raises a ValueError for an unknown `all_reduce` name."""
  if all_reduce not in ALGORITHMS:
    raise ValueError(
        "all_reduce must be one of {}. Received: {!r}.".format(
            ", ".join(repr(a) for a in ALGORITHMS), all_reduce))


def resolve_algorithm(all_reduce: str, devices: Sequence[str]) -> str:
  """The algorithm `all_reduce` means on `devices`; checks that NCCL can run."""
  on_gpus = all(
      tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)
  if all_reduce == AUTO:
    return NCCL if on_gpus and tf.test.is_built_with_cuda() else GATHER
  if all_reduce == NCCL and not (on_gpus and tf.test.is_built_with_cuda()):
    reason = ("this TensorFlow is built without CUDA"
              if on_gpus else "the towers are not all GPUs: {}".format(
                  ", ".join(devices)))
    raise ValueError(
        "all_reduce='nccl' needs GPU towers and a TensorFlow built with CUDA "
        "(NCCL), but {}. Use all_reduce='ring' or 'gather', or 'auto' to "
        "pick one for the devices.".format(reason))
  return all_reduce


def all_reduce_grads(per_tower: Sequence[Sequence[Any]], devices: Sequence[str],
                     algorithm: str, compact: bool = False, cross=None
                    ) -> List[List[Optional[Any]]]:
  """Per tower, the sum over towers of each gradient, on the tower's device.

  `per_tower[i][p]` is tower i's gradient for variable p (a Tensor,
  `IndexedSlices` or None), with towers that had no rows already zeroed.
  Where every tower's gradient is None the result is None. With `cross` (a
  `replicate.cluster.sync_cluster.CrossTask`), the sum is over every tower
  of every task of a synchronous cluster: this task's sum on tower 0's
  device, then summed across tasks (packed as here), then copied back.
  """
  num_towers = len(devices)
  per_tower = [list(tower) for tower in per_tower]  # filled in below
  results = [[None] * len(per_tower[0]) for _ in devices]
  packs = {}  # dtype -> positions whose gradients are packed together
  singles = []
  sparse = []  # positions of sparse gradients, gathered together
  reducer = _reducer(algorithm, devices, cross)
  for position in range(len(per_tower[0])):
    grads = [tower[position] for tower in per_tower]
    if all(g is None for g in grads):
      continue
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
      sparse.append(position)
      continue
    grads = _zeros_for_missing(grads, devices)
    for index, grad in enumerate(grads):
      per_tower[index][position] = grad
    if _is_small(grads[0]):
      packs.setdefault(grads[0].dtype, []).append(position)
    else:
      singles.append(position)
  if sparse:
    gathered = reducer.gather_slices(
        [[tower[p] for tower in per_tower] for p in sparse])
    for position, per_position in zip(sparse, gathered):
      for index, summed in enumerate(per_position):
        results[index][position] = summed
  for positions in packs.values():
    with tf.name_scope("packed_all_reduce"):
      buffers = [_pack([per_tower[i][p] for p in positions], devices[i])
                 for i in range(num_towers)]
      summed = _compacted(reducer.reduce, buffers, devices, compact)
      for index in range(num_towers):
        shapes = [per_tower[index][p].shape for p in positions]
        for position, grad in zip(positions, _unpack(summed[index], shapes,
                                                     devices[index])):
          results[index][position] = grad
  for position in singles:
    with tf.name_scope("all_reduce"):
      summed = _compacted(reducer.reduce, [t[position] for t in per_tower],
                          devices, compact)
    for index in range(num_towers):
      results[index][position] = summed[index]
  return results


class _Reducer(NamedTuple):
  """How one call's per-tower values become per-tower results."""
  reduce: Callable  # per-tower dense tensors -> per-tower sums
  # [per-tower IndexedSlices of each variable] -> the same, all-gathered
  gather_slices: Callable


# (per-tower tensors, devices) -> per-tower sums: `gather`'s dense sum while
# inside `gather_reduce_replaced`, else None.
_replaced_gather_reduce: Optional[Callable] = None


@contextlib.contextmanager
def gather_reduce_replaced(reduce: Callable):
  """Inside, `gather` sums dense gradients with `reduce(tensors, devices)`.

  Not an API: the benchmarks' seam (`benchmarks/hand_ring.py`), to time
  another all-reduce built from graph ops against `gather` and `ring`.
  `reduce` gets one tensor per tower (`tensors[i]` on `devices[i]`) and
  returns, per tower, the sum on that tower's device; `gather_reduce` is
  the one it replaces. Process-wide while inside; sparse gradients are
  gathered as with `gather`.
  """
  global _replaced_gather_reduce  # pylint: disable=global-statement
  previous, _replaced_gather_reduce = _replaced_gather_reduce, reduce
  try:
    yield
  finally:
    _replaced_gather_reduce = previous


def _reducer(algorithm, devices, cross=None) -> _Reducer:
  if cross is not None:
    return _Reducer(
        functools.partial(_over_tasks, devices=devices, cross=cross),
        functools.partial(_slices_over_tasks, devices=devices, cross=cross))
  if algorithm not in (RING, NCCL):
    reduce = _replaced_gather_reduce or gather_reduce
    return _Reducer(functools.partial(reduce, devices=devices),
                    _each(functools.partial(_concat_slices, devices=devices)))
  # One object per call: it reads the keys still free from the graph.
  launcher = collectives.Collectives(devices, communication_hint=algorithm)

  def reduce_collectively(tensors):
    # A shape known only at run time may change between steps, which a
    # collective instance refuses (see Collectives.all_gather_slices).
    if collectives.supports(tensors[0].dtype) and all(
        t.shape.is_fully_defined() for t in tensors):
      return launcher.all_reduce(tensors)
    return gather_reduce(tensors, devices)

  def gather_collectively(grads):
    with tf.name_scope("all_gather"):
      gathered = launcher.all_gather_slices(grads)
    return gathered if gathered is not None else _concat_slices(grads,
                                                                devices)

  return _Reducer(reduce_collectively, _each(gather_collectively))


def _each(gather: Callable) -> Callable:
  """`gather` of one variable's slices, for each variable's."""
  return lambda many: [gather(grads) for grads in many]


def _over_tasks(tensors, devices, cross):
  """This task's sum on tower 0's device, summed across tasks, copied back."""
  with tf.device(devices[0]):
    local = tf.math.add_n(tensors) if len(tensors) > 1 else tensors[0]
  total = cross.sum(local, name="all_reduce_over_tasks")
  copies = [total]
  for device in devices[1:]:
    with tf.device(device):
      copies.append(tf.identity(total))
  return copies


def _slices_over_tasks(many, devices, cross):
  """Sparse gradients across tasks as slices: an all-gather, never dense.

  For each variable's per-tower slices (`many`): this task's towers' slices
  are concatenated on tower 0's device (tower order: this task's batch
  order), then every task's are all-gathered (`CrossTask.gather_slices`:
  lengths first, as each task's differ; every variable's in the same few
  collectives) and concatenated in rank order, which is the concatenated
  batches' order: the optimizer gets the slices one device's would,
  duplicates and all, and sums duplicates as it does there. Every tower
  gets a copy, so every copy takes the same update. What travels grows
  with the rows looked up, not with the variable. A tower's dense gradient
  (rare: the variable also used densely there) joins as slices of every
  row.
  """
  locals_ = []
  for grads in many:
    present = [_as_slices(g) for g in grads if g is not None]
    with tf.device(devices[0]), tf.name_scope("slices_over_tasks"):
      if len(present) == 1:
        local = present[0]
      else:
        local = tf.IndexedSlices(
            tf.concat([s.values for s in present], axis=0),
            tf.concat([tf.cast(s.indices, tf.int64) for s in present],
                      axis=0), present[0].dense_shape)
    dense_shape = next((s.dense_shape for s in present
                        if s.dense_shape is not None), None)
    locals_.append((local, dense_shape))
  gathered = cross.gather_slices([(local.values, local.indices)
                                  for local, _ in locals_])
  results = []
  for (values, indices), (_, dense_shape) in zip(gathered, locals_):
    summed = tf.IndexedSlices(values, indices, dense_shape)
    copies = [summed]
    for device in devices[1:]:
      with tf.device(device):
        copies.append(tf.IndexedSlices(tf.identity(summed.values),
                                       tf.identity(summed.indices),
                                       summed.dense_shape))
    results.append(copies)
  return results


def _as_slices(value):
  """`value` as `IndexedSlices` (a dense gradient: slices of every row)."""
  if isinstance(value, tf.IndexedSlices):
    return value
  rows = tf.shape(value, out_type=tf.int64)[0]
  return tf.IndexedSlices(value, tf.range(rows),
                          tf.shape(value, out_type=tf.int64))


def _concat_slices(grads, devices):
  """Every tower's slices, concatenated on each tower's device."""
  present = [g for g in grads if g is not None]
  gathered = []
  for device in devices:
    with tf.device(device), tf.name_scope("all_gather"):
      gathered.append(tf.IndexedSlices(
          tf.concat([g.values for g in present], axis=0),
          tf.concat([tf.cast(g.indices, tf.int64) for g in present], axis=0),
          present[0].dense_shape))
  return gathered


def _zeros_for_missing(grads, devices):
  """A tower with no gradient for a variable others have contributes zeros."""
  present = next(g for g in grads if g is not None)
  filled = []
  for grad, device in zip(grads, devices):
    if grad is None:
      with tf.device(device):
        grad = tf.zeros_like(present)
    filled.append(grad)
  return filled


def _is_small(grad) -> bool:
  return (grad.shape.is_fully_defined() and
          grad.shape.num_elements() <= PACK_MAX_ELEMENTS)


def _pack(grads, device):
  with tf.device(device):
    return tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)


def _unpack(buffer, shapes, device):
  with tf.device(device):
    pieces = tf.split(buffer, [s.num_elements() for s in shapes])
    return [tf.reshape(p, s) for p, s in zip(pieces, shapes)]


def _compacted(reduce, tensors, devices, compact):
  """`reduce`, in float16 for float32 tensors when `compact`."""
  if not compact or tensors[0].dtype != tf.float32:
    return reduce(tensors)
  halves = []
  for tensor, device in zip(tensors, devices):
    with tf.device(device):
      halves.append(tf.cast(tensor, tf.float16))
  summed = reduce(halves)
  restored = []
  for tensor, device in zip(summed, devices):
    with tf.device(device):
      restored.append(tf.cast(tensor, tf.float32))
  return restored


def gather_reduce(tensors: Sequence[tf.Tensor],
                  devices: Sequence[str]) -> List[tf.Tensor]:
  """`gather`'s dense sum: on tower 0's device, copied to every tower's."""
  with tf.device(devices[0]):
    total = tf.math.add_n(tensors)
  copies = [total]
  for device in devices[1:]:
    with tf.device(device):
      copies.append(tf.identity(total))
  return copies
