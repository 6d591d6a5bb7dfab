"""The towers' `STATISTIC` writes, combined into tower 0's: the whole batch's.

On which weights: a statistic is a moving average, or a variable declared
`aggregation=MEAN`, written from what each tower computed on its rows.
- A value computed from the tower's loss (the spec's loss, or a part of it
  the loss is a sum of: a term of it, as the CIFAR-10 tutorial's
  `ExponentialMovingAverage.apply(losses + [total_loss])` averages) is the
  loss's: its whole batch's value is the towers' values weighted as the
  loss is (`replicate.gradients.weighting.TowerWeights.whole_batch_value`:
  by the stated `replicate.loss_denominator`s, else term by term as the loss
  rule reads it; a padded token mean is its tokens' sum over every tower's
  count of tokens, whatever the shards hold). That value, the same in every
  tower, replaces the tower's in the ops that compute the write from it,
  and tower 0's write is made as it is: a moving average of the loss moves
  as one device's does, and `loss`, `loss_over_towers` and every average of
  the loss use the same weights.
- Any other value (batch norm's moments, a moving average of
  `tf.reduce_mean(x)`) is combined by the towers' shares of the batch
  `n_i / n`: such a value is a mean over the tower's rows (one per channel
  for batch norm), and the batch's mean is the share-weighted mean of the
  towers' means. An `assign` of `(1 - f) m + f x_i`, or an `assign_sub` of
  `f (m - x_i)`, becomes the same with `x` the share-weighted mean of the
  `x_i`: a moving mean moves as it would with the whole batch's mean.

A tower on a stand-in row (no rows) weighs 0 in both.
"""

from typing import Dict, List

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.gradients import loss_ops
from replicate.shard import sharding
from replicate.state import write_edits
from replicate.call import layout as layout_lib

# Ops through which a part of the loss stays a part of it: the loss is a
# sum of what is behind them (see `replicate.gradients.loss_rule`).
_SUMMING = ("Add", "AddV2", "AddN")
_PASSING = loss_ops.PASS + ("Cast",) + loss_ops.SHAPED


def combine(writes, layout, progress, tower_specs, weights) -> None:
  """Makes tower 0's statistic writes write the whole batch's values.

  `writes[i]` are tower i's `STATISTIC` changes, in build order.
  """
  for change in writes[0]:
    write_edits.check_rewritable(change.op)
  names = lambda changes: [c.variable.op.name for c in changes]
  for index, tower_writes in enumerate(writes[1:], start=1):
    if layout.towers[index].has_rows is False:
      # A tower on a stand-in row: its loss and gradients are dropped, so
      # the step may run none of its writes; any it runs change nothing.
      for change in tower_writes:
        write_edits.change_nothing(change.op,
                                   after=[c.op for c in writes[0]])
      writes[index] = []
      continue
    if names(tower_writes) != names(writes[0]):
      raise ValueError(
          "Tower {}'s step updates the statistics {} and tower 0's {} "
          "(writes through UPDATE_OPS, moving averages, or of variables "
          "declared aggregation=MEAN): each tower's model_fn must make the "
          "same updates (batch norm, moving averages), whatever its "
          "data.".format(index, names(tower_writes), names(writes[0])))
  with tf.name_scope("update_ops_over_towers"):
    of_loss = _of_the_loss(writes, layout, progress, tower_specs, weights)
    tower0_writes = [c.op for c in writes[0]]
    positions = [p for p in range(len(tower0_writes)) if p not in of_loss]
    sums = [_share_weighted(writes, position, layout)
            for position in positions]
    if layout.spans_tasks and sums:
      # Every statistic of the step in one collective per dtype.
      sums = layout.cross_task.sum_all(sums, name="statistics_over_tasks")
    for position, tower0_write in enumerate(tower0_writes):
      for tower_writes in writes[1:]:
        if tower_writes:
          write_edits.change_nothing(tower_writes[position].op,
                                     after=[tower0_write])
    for position, summed in zip(positions, sums):
      tower0_write = tower0_writes[position]
      _tf.update_input(tower0_write, 1, write_edits.as_dtype_of(
          summed, tower0_write.inputs[1]))


def _share_weighted(writes, position, layout):
  """The towers' values of the write at `position`, by their shares."""
  terms = []
  for index, tower_writes in enumerate(writes):
    rows = layout.towers[index].has_rows
    if rows is False:
      continue
    value = tower_writes[position].op.inputs[1]
    if not value.dtype.is_floating:  # a count: weighed in float
      value = tf.cast(value, tf.float64)
    share = sharding.weight_as(layout.towers[index].share, value.dtype)
    terms.append(sharding.zero_unless_rows(value * share, rows))
  return tf.math.add_n(terms)


def _of_the_loss(writes, layout, progress, tower_specs, weights) -> set:
  """The positions of the writes computed from the loss, each made from the
  whole batch's value of the part of the loss it reads."""
  if weights is None or tower_specs[0].loss is None or not writes[0]:
    return set()
  towers = [index for index, tower_writes in enumerate(writes)
            if index == 0 or tower_writes]
  parts = [_loss_parts(spec.loss, progress, index)
           for index, spec in enumerate(tower_specs)]
  whole: Dict[str, tf.Tensor] = {}  # tower 0's name of a part -> its value
  downstream = {}  # tower -> the ops computed from its loss's parts
  positions = set()
  for position, change in enumerate(writes[0]):
    found = {}
    for index in towers:
      op = writes[index][position].op
      if index not in downstream:
        downstream[index] = graph_walk.ops_after(parts[index].values(),
                                                  include_starts=False)
      found[index] = (_parts_read(op, parts[index], progress, index)
                      if op in downstream[index] else {})
    if not found[0]:
      continue
    for index in towers:
      if sorted(found[index]) != sorted(found[0]):
        raise ValueError(
            "Tower {}'s write {!r} is computed from the parts of its loss "
            "{}, tower 0's {}: each tower's model_fn must compute its "
            "statistics the same way, whatever its data.".format(
                index, writes[index][position].op.name,
                sorted(found[index]), sorted(found[0])))
    for name in sorted(found[0]):
      if name not in whole:
        whole[name] = weights.whole_batch_value(
            ("statistic", name), [_part_of(tower_parts, name, index)
                                  for index, tower_parts in enumerate(parts)],
            progress.rows_of)
      for index in towers:
        _read_instead(found[index][name], whole[name], tower_specs[index],
                      writes[index][position].op)
    for index in towers:
      write = writes[index][position].op
      if progress.rows_of(index).depend([write.inputs[1]]):
        raise ValueError(
            "Tower {}'s statistic write {!r} (of {!r}) is computed from its "
            "loss ({}) "
            "and from its rows in another way too. replicate_model_fn makes "
            "a statistic of the loss from the whole batch's loss, weighted "
            "as the loss is, and cannot tell how the rest combines over the "
            "batch. Fix: keep a separate moving average of the loss and of "
            "the other value.".format(
                index, write.name, writes[index][position].variable.op.name,
                ", ".join(sorted(found[0]))))
    positions.add(position)
  return positions


def _loss_parts(loss, progress, index) -> Dict[str, tf.Tensor]:
  """{tower 0's name: tensor} of the tower's loss and the parts it sums."""
  rows = progress.rows_of(index)
  tower_ops = frozenset(progress.tower_ops[index])
  found = {}
  pending = [tf.convert_to_tensor(loss)]
  while pending:
    t = pending.pop()
    if t.op not in tower_ops or not loss_ops.one_element(t):
      continue
    name = layout_lib.to_tower0_name(t.name, index)
    if name in found:
      continue
    found[name] = t
    op = t.op
    if op.type in _SUMMING + ("Sub", "Neg") + _PASSING:
      pending.extend(x for x in op.inputs if x.dtype.is_floating)
    elif op.type == "Mul":
      # A part scaled by a value not computed from the rows (a weight).
      a, b = op.inputs
      pending.extend(x for x, scale in ((a, b), (b, a))
                     if loss_ops.one_element(scale) and
                     not rows.depend([scale]))
    elif op.type in loss_ops.DIVS and not rows.depend([op.inputs[1]]):
      pending.append(op.inputs[0])
  return found


def _part_of(parts, name, index):
  """The tower's part of its loss that tower 0 names `name`."""
  if name not in parts:
    raise ValueError(
        "Tower {}'s loss has no part {!r}, which tower 0's statistics are "
        "computed from: each tower's model_fn must compute its loss the "
        "same way, whatever its data.".format(index, name))
  return parts[name]


def _parts_read(write, parts, progress, index):
  """{name: (part, its readers on the way to the write)} of the parts of
  the loss the write's value is computed from (the nearest to it)."""
  tower_ops = frozenset(progress.tower_ops[index])
  by_tensor = {t.ref(): name for name, t in parts.items()}
  found = {}
  pending, seen = [write.inputs[1]], set()
  while pending:
    t = pending.pop()
    if t.ref() in seen or t.op not in tower_ops:
      continue
    seen.add(t.ref())
    name = by_tensor.get(t.ref())
    if name is not None:
      found.setdefault(name, (t, set()))
      continue
    pending.extend(t.op.inputs)
  if not found:
    return found
  on_the_way = set(graph_walk.ops_behind([write.inputs[1]], within=tower_ops))
  on_the_way.add(write)
  for name, (t, readers) in found.items():
    readers.update(op for op in t.consumers() if op in on_the_way)
  return found


def _read_instead(part, value, tower_spec, write) -> None:
  """The ops on the way from `part` to `write` read `value` instead."""
  t, readers = part
  behind_loss = set(graph_walk.ops_behind([tower_spec.loss]))
  for reader in readers:
    if reader in behind_loss:
      raise ValueError(
          "The op {!r} computes both the loss and the statistic {!r} from "
          "the loss's part {!r}; replicate_model_fn makes the statistic "
          "from the whole batch's value of that part, and cannot change "
          "the loss. Fix: compute the statistic from the loss itself "
          "(e.g. ExponentialMovingAverage.apply([loss])).".format(
              reader.name, write.name, t.name))
    for position, x in enumerate(reader.inputs):
      if x is t:
        _tf.update_input(reader, position, tf.cast(value, t.dtype))
