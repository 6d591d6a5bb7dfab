"""The hand ring: an all-reduce built from graph ops, for comparison only.

The ring `replicate` built before its `ring` used TensorFlow's collective
ops: one graph op per hop. Each tower's tensor is split into N chunks; each
chunk is summed round the ring of devices (a reduce-scatter), then passed
round so every device has every summed chunk (an all-gather). It is not an
`all_reduce` value: the `replicate-N-handring` configurations train with
`all_reduce="gather"` and build its dense sums this way instead, through
`replicate.communication.allreduce.gather_reduce_replaced`; sparse
gradients are gathered as with `gather`.
"""

import inspect
from typing import Callable, List, Sequence

import tensorflow as tf

from benchmarks import configs
from replicate.communication import allreduce

# The replicate_model_fn arguments of a hand-ring configuration, to which
# `with_hand_ring` then applies.
ARGUMENTS = configs.REPLICATE_ARGUMENTS["handring"]


def reduce(tensors: Sequence[tf.Tensor],
           devices: Sequence[str]) -> List[tf.Tensor]:
  """Reduce-scatter round the ring, then all-gather round it.

  `tensors[i]` is on `devices[i]`; returns, per device, the sum on it. A
  shape known only at run time is summed as `gather` does: chunks need a
  static size.
  """
  count = len(devices)
  shape = tensors[0].shape
  if not shape.is_fully_defined():
    return allreduce.gather_reduce(tensors, devices)
  elements = shape.num_elements()
  sizes = [elements // count + (1 if c < elements % count else 0)
           for c in range(count)]
  chunks = []
  for tensor, device in zip(tensors, devices):
    with tf.device(device):
      chunks.append(tf.split(tf.reshape(tensor, [-1]), sizes))
  owned = []  # chunk c, summed, ends on device c
  for c in range(count):
    start = (c + 1) % count
    summed = chunks[start][c]
    for step in range(1, count):
      device = (start + step) % count
      with tf.device(devices[device]):
        summed = summed + chunks[device][c]
    owned.append(summed)
  on_device = [[None] * count for _ in range(count)]  # [device][chunk]
  for c in range(count):
    on_device[c][c] = owned[c]
    for step in range(1, count):
      device = (c + step) % count
      with tf.device(devices[device]):
        on_device[device][c] = tf.identity(on_device[device - 1][c])
  reduced = []
  for device, pieces in enumerate(on_device):
    with tf.device(devices[device]):
      reduced.append(tf.reshape(tf.concat(pieces, axis=0), shape))
  return reduced


def with_hand_ring(replicated_model_fn: Callable) -> Callable:
  """`replicated_model_fn` (made with `ARGUMENTS`) summing by the hand ring.

  The returned `model_fn` has the wrapped one's parameters, which the
  Estimator reads to decide what to pass; the replacement holds only while
  it builds its graph.
  """
  if "params" in inspect.signature(replicated_model_fn).parameters:
    def model_fn(features, labels, mode, params=None, config=None):
      with allreduce.gather_reduce_replaced(reduce):
        return replicated_model_fn(features, labels, mode, params=params,
                                   config=config)
  else:
    def model_fn(features, labels, mode, config=None):
      with allreduce.gather_reduce_replaced(reduce):
        return replicated_model_fn(features, labels, mode, config=config)
  model_fn.__name__ = getattr(replicated_model_fn, "__name__", "model_fn")
  return model_fn
