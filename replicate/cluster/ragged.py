"""Collectives across tasks of tensors whose length changes every step.

On why: CollectiveGatherV2 and CollectiveReduceV2 need the same shape on
every task, and an instance keeps the shape of its first run (another
shape on a later step aborts: "Shape mismatch in the collective
instance"). A step's sparse gradients and `replicate.all_rows`'s rows have
as many rows as the step's batch touches, different on each task and at
each step.

On the buckets: such a tensor is padded to the smallest power of two not
below its length and sent on an instance key of that power (`_BUCKETS`
keys reserved per collective, one shape each, the same on every task,
since every task knows every length); the padding is dropped after. What
travels grows with the rows, at most twice the longest task's, never with
a variable. The keys are reserved in building order like every step's
collective; the collectives carry no timeout (the step's watchdog bounds
them).
"""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

# How many padded lengths a ragged collective can use: 1, 2, 4, ... 2**30.
_BUCKETS = 31


def gather_ragged(cross, tensors: Sequence[tf.Tensor],
                  counts: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
  """Every task's `tensors`, of a length its own, concatenated in rank order.

  `cross`: a `replicate.cluster.sync_cluster.CrossTask`. Every tensor has
  the same length `k` on a task (dimension 0); `k` differs between tasks
  and steps, and may be 0. First an all-gather of every task's `k` (unless
  the caller gives `counts`, every task's `k` in rank order); then each
  tensor is padded to the bucket of the longest `k` and all-gathered, and
  the padding dropped by the gathered lengths.
  """
  mine = tf.shape(tensors[0], out_type=tf.int32)[:1]
  if counts is None:
    counts = cross.gather(mine)  # [tasks]
  counts = tf.cast(counts, tf.int32)
  bucket, cap = _bucket(tf.reduce_max(counts))
  kept = tf.reshape(tf.range(cap)[tf.newaxis, :] < counts[:, tf.newaxis],
                    [-1])
  results = []
  for tensor in tensors:
    gathered = cross.step_collective(
        "CollectiveGatherV2", _padded(tensor, cap - mine[0]),
        _bucket_key(cross, tensor.graph, bucket))
    result = tf.boolean_mask(gathered, kept)
    result.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    results.append(result)
  return results


def gather_ragged_groups(cross, pairs: Sequence[Tuple[tf.Tensor, tf.Tensor]]
                        ) -> List[Tuple[tf.Tensor, tf.Tensor]]:
  """`gather_ragged` of several (values, indices) pairs, in few collectives.

  The step's sparse gradients (one pair per variable: a CTR model has one
  per table and part) would take 3 collectives each. Here one all-gather
  carries every task's lengths (per group and per pair), then each group
  of pairs whose values share dtype and row shape is concatenated and
  gathered as one pair; each task's rows are then split back by pair
  (`dynamic_partition` keeps their order), so each result is every task's
  rows of that pair in rank order, as `gather_ragged` gives them.
  """
  groups = {}  # (dtype, row shape) -> positions in `pairs`
  for position, (values, _) in enumerate(pairs):
    rows = values.shape[1:]
    key = ((values.dtype.base_dtype, tuple(rows.as_list()))
           if rows.is_fully_defined() else position)
    groups.setdefault(key, []).append(position)
  groups = list(groups.values())
  lengths = [tf.shape(values, out_type=tf.int32)[0] for values, _ in pairs]
  # Each group's length, then the pairs' of the groups of several.
  shared = [p for group in groups if len(group) > 1 for p in group]
  mine = tf.stack([tf.add_n([lengths[p] for p in group]) for group in groups]
                  + [lengths[p] for p in shared])
  every = cross.gather(mine[tf.newaxis])  # [tasks, groups + len(shared)]
  results = [None] * len(pairs)
  for number, group in enumerate(groups):
    values, indices = gather_ragged(
        cross, [tf.concat([pairs[p][0] for p in group], axis=0),
                tf.concat([tf.cast(pairs[p][1], tf.int64) for p in group],
                          axis=0)], counts=every[:, number])
    if len(group) == 1:
      results[group[0]] = (values, indices)
      continue
    # Each gathered row's place in the group: task by task, pair by pair.
    per_pair = tf.gather(every[:, len(groups):],
                         [shared.index(p) for p in group], axis=1)
    places = tf.repeat(tf.tile(tf.range(len(group)), [tf.shape(every)[0]]),
                       tf.reshape(per_pair, [-1]))
    for position, part_values, part_indices in zip(
        group, tf.dynamic_partition(values, places, len(group)),
        tf.dynamic_partition(indices, places, len(group))):
      part_values.set_shape(pairs[position][0].shape[:0].concatenate(
          [None]).concatenate(pairs[position][0].shape[1:]))
      results[position] = (part_values, part_indices)
  return results


def sum_ragged(cross, tensor: tf.Tensor) -> tf.Tensor:
  """The sum over tasks of `tensor`, whose length (dimension 0) is the same
  on every task but changes between steps (`replicate.all_rows`'s gradient
  over every task's rows): padded to its bucket, summed, cut back."""
  rows = tf.shape(tensor, out_type=tf.int32)[0]
  bucket, cap = _bucket(rows)
  summed = cross.step_collective(
      "CollectiveReduceV2", _padded(tensor, cap - rows),
      _bucket_key(cross, tensor.graph, bucket), merge_op="Add",
      final_op="Id")
  result = summed[:rows]
  result.set_shape(tensor.shape)
  return result


def _bucket(length: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """(b, 2**b): the smallest power of two 2**b not below `length`."""
  caps = tf.constant([2 ** b for b in range(_BUCKETS)], tf.int32)
  bucket = tf.reduce_sum(tf.cast(caps < length, tf.int32))
  return bucket, caps[bucket]


def _bucket_key(cross, graph: tf.Graph, bucket: tf.Tensor) -> tf.Tensor:
  """The instance key of `bucket`, among `_BUCKETS` fresh keys reserved."""
  return cross.reserve_keys(graph, _BUCKETS) + bucket


def _padded(tensor: tf.Tensor, missing: tf.Tensor) -> tf.Tensor:
  """`tensor` with `missing` rows of zeros after its own."""
  return tf.pad(tensor, [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1))
