"""A ps-held variable's slices: straight to the ps, or gathered to every task.

On the straight form (where the `model_fn` reads nothing of the gradient):
each task sums its towers' slices of a ps-held variable (duplicate rows
summed once, `replicate.cluster.hybrid.duplicates_summed`) and adds them
to an accumulator on the variable's ps task (a `SparseConditionalAccumulator`
summing, one per variable and call, the same `shared_name` in every
task's graph, so one object on the ps). The chief takes the sum once every
task's slices are in and applies the optimizer's one update to it, on the
ps (the update is colocated with the variable). What travels is each
task's own slices, once, to the ps; the summed ones never leave it. The
sum is one device's: the optimizer sums an `IndexedSlices`' duplicate
rows before its update, and here they are summed before it too, in
another order (float rounding).

On the gathered form (where user code reads the gradient between
`compute_gradients` and `apply_gradients`: a clip by global norm, a
summary): every task all-gathers every task's slices
(`CrossTask.gather_slices`), so that what the user's code computes from
them is the whole batch's on every task, duplicate rows as one device has
them (a global norm counts each slice: summing them first would change
it); the chief applies them.

On the choice: made once the `model_fn` is built (`settled`), per
variable, from what reads the summed gradient: only the optimizer's update
(ops `TowerOptimizer` built applying, not its `gradient_transformers`)
lets it go straight. Every task builds the same graph but that update,
which only the chief builds (a worker's update leaves out what lives on a
ps task), so every task chooses alike; a task that chose otherwise would
have other collectives, which the start's check of the model refuses.

On the step: the accumulator's `take` waits for every task's slices; a
task's `apply` runs after the check that every input goes on (so an
input's end adds nothing), and the step's train_op waits for it, so the
barrier after the ps update (`replicate.cluster.hybrid.after_the_ps_update`)
comes after it. A slice is never dropped as stale (its step is the
largest): the chief's take of a step ends before any task's next apply.
"""

from typing import Any, Callable, List, NamedTuple, Sequence, Tuple

import tensorflow as tf

from replicate import _tf
from replicate.call import current
from replicate.cluster import hybrid
from replicate.gradients import aggregation
from replicate.gradients import stand_ins
from replicate.shard import sharding

# The step every slice is applied at: never below the accumulator's own
# (which a take moves on by 1), so no slice is dropped as stale.
_NEVER_STALE = 2 ** 62


class Pending(NamedTuple):
  """One ps-held variable's summed gradient, to be settled."""
  stand_in: tf.IndexedSlices  # what the update (and user code) reads
  local: tf.IndexedSlices  # this task's towers' slices, concatenated
  variable: Any
  # The call's `replicate.call.progress.Progress`: which ops the
  # optimizer's updates built, and their gradient_transformers.
  progress: Any


def held_apart(per_tower: Sequence[list], has_rows: Sequence[Any],
               tower_devices: Sequence[str], combine: Callable
              ) -> Tuple[list, List[Pending]]:
  """Every variable's sum over every task's towers (`combine(per_tower)`),
  but a ps-held variable's slices: a `Pending` stand-in for them each, and
  those records."""
  sliced = [position for position, (_, variable) in enumerate(per_tower[0])
            if hybrid.on_ps(variable) and any(
                isinstance(tower[position][0], tf.IndexedSlices)
                for tower in per_tower)]
  summed = combine([[(None, variable) if position in sliced else
                     (grad, variable)
                     for position, (grad, variable) in enumerate(tower)]
                    for tower in per_tower])
  if not sliced:
    return summed, []
  progress = current.current_context().progress
  records, by_variable = [], {}
  for position in sliced:
    variable = per_tower[0][position][1]
    local = local_slices([tower[position][0] for tower in per_tower],
                         has_rows, variable, tower_devices[0])
    records.append(Pending(stand_ins.stand_in(local, "ps_slices"), local,
                           variable, progress))
    by_variable[variable.ref()] = records[-1].stand_in
  return [(by_variable.get(variable.ref(), grad), variable)
          for grad, variable in summed], records


def settled(spec: tf.estimator.EstimatorSpec, cross,
            records: Sequence[Pending]) -> tf.estimator.EstimatorSpec:
  """`spec` once each record's slices go straight to the ps or are
  gathered: its train_op waits for this task's slices to be on the ps.
  Logs how many went each way."""
  goes = [goes_straight(record) for record in records]
  gathered(cross, [r for r, go in zip(records, goes) if not go])
  ways = [r for r, go in zip(records, goes) if go]
  if records:
    tf.compat.v1.logging.info(
        "Slices of the ps tasks' variables: %d straight to the ps, %d "
        "gathered to every task (read between compute_gradients and "
        "apply_gradients).", len(ways), len(records) - len(ways))
  waited, hooks = straight(cross, ways, cross.group.is_chief)
  if not waited:
    return spec
  return spec._replace(train_op=tf.group(spec.train_op, *waited),
                       training_chief_hooks=list(
                           spec.training_chief_hooks) + hooks)


def local_slices(grads: Sequence[Any], has_rows: Sequence[Any], variable,
                 device: str) -> tf.IndexedSlices:
  """This task's towers' slices of `variable`, concatenated in tower order
  (a tower without rows gives none)."""
  present = [aggregation.as_slices(sharding.zero_unless_rows(g, rows))
             for g, rows in zip(grads, has_rows)
             if g is not None and rows is not False]
  with tf.device(device), tf.name_scope("ps_slices"):
    if not present:
      shape = variable.shape
      return tf.IndexedSlices(
          tf.zeros([0] + shape[1:].as_list(), variable.dtype.base_dtype),
          tf.zeros([0], tf.int64), tf.constant(shape.as_list(), tf.int64))
    dense_shape = next((s.dense_shape for s in present
                        if s.dense_shape is not None), None)
    return tf.IndexedSlices(
        tf.concat([s.values for s in present], axis=0),
        tf.concat([tf.cast(s.indices, tf.int64) for s in present], axis=0),
        dense_shape)


def goes_straight(record: Pending) -> bool:
  """Whether only the optimizer's update reads the sum (through
  replicate's stand-ins, every reader): no user code, no
  gradient_transformers."""
  readers, stack, seen = [], [record.stand_in.values,
                               record.stand_in.indices], set()
  while stack:
    tensor = stack.pop()
    for consumer in tensor.consumers():
      if consumer in seen:
        continue
      seen.add(consumer)
      if consumer.type == "PlaceholderWithDefault":  # a stand-in
        stack.extend(consumer.outputs)
      else:
        readers.append(consumer)
  return all(op in record.progress.update_built and
             op not in record.progress.transformers_built
             for op in readers)


def straight(cross, records: Sequence[Pending], is_chief: bool
            ) -> Tuple[List[tf.Operation], List["EmptiedAtStart"]]:
  """Each record's slices added to its accumulator on the ps; on the chief,
  the sum taken there and given to the update. The ops the step's
  train_op must wait for, and (the chief's) the hook that empties the
  accumulators as its session starts."""
  waited, accumulators = [], []
  with tf.device(cross.device), tf.name_scope("ps_slices"):
    owns = [hybrid.duplicates_summed(record.local) for record in records]
  arrived = _on_their_ps(cross, records, owns)
  for number, (record, own) in enumerate(zip(records, arrived)):
    variable = record.variable
    device = variable.device
    with tf.compat.v1.colocate_with(None, ignore_existing=True), \
        tf.device(device), tf.name_scope("ps_slices"):
      accumulator = tf.compat.v1.SparseConditionalAccumulator(
          own.values.dtype.base_dtype, shape=variable.shape,
          shared_name="replicate_ps_slices_{}_{}".format(
              number, variable.op.name), reduction_type="SUM")
      with cross.in_step():
        added = accumulator.apply_indexed_slices_grad(
            tf.IndexedSlices(own.values, own.indices,
                             tf.constant(variable.shape.as_list(), tf.int64)),
            local_step=tf.constant(_NEVER_STALE, tf.int64))
      waited.append(added)
      if not is_chief:
        continue
      accumulators.append(accumulator)
      with tf.control_dependencies([added]):
        summed = accumulator.take_indexed_slices_grad(
            num_required=cross.group.size)
    stand_ins.connect(record.stand_in, tf.IndexedSlices(
        summed.values, summed.indices, record.stand_in.dense_shape))
    _on_the_ps(record.stand_in, device)
  return waited, [EmptiedAtStart(accumulators)] if accumulators else []


class EmptiedAtStart(tf.compat.v1.train.SessionRunHook):
  """The chief's: empties the accumulators as its session starts.

  An accumulator lives on its ps task as long as the task does; slices a
  task added in a step that never ended (a task that died in it) would
  join the next run's first step, when the ps tasks outlive the training
  tasks (a cluster manager restarting only those). No task of this run
  adds any before the chief's first step, which runs after this.
  """

  def __init__(self, accumulators):
    with tf.name_scope("ps_slices_emptied"):
      self._counts = [a.num_accumulated() for a in accumulators]
      self._required = tf.compat.v1.placeholder(tf.int32, [])
      self._takes = [a.take_indexed_slices_grad(self._required).indices
                     for a in accumulators]

  def after_create_session(self, session, coord):
    del coord
    for count, take in zip(session.run(self._counts), self._takes):
      if count:
        session.run(take, {self._required: count})


def _on_their_ps(cross, records: Sequence[Pending],
                 owns: Sequence[tf.IndexedSlices]) -> List[tf.IndexedSlices]:
  """Each of `owns` (this task's slices of a record's variable) on the ps
  task of its variable: those of one ps task, one dtype and row shape
  travel as one tensor of values and one of indices (and their lengths),
  split there: a CTR model has a table part per field and ps task."""
  groups = {}
  for position, (record, own) in enumerate(zip(records, owns)):
    rows = own.values.shape[1:]
    groups.setdefault((record.variable.device, own.values.dtype.base_dtype,
                       tuple(rows.as_list()) if rows.is_fully_defined()
                       else position), []).append(position)
  arrived = list(owns)
  for (device, _, _), group in groups.items():
    if len(group) == 1:
      continue
    with tf.device(cross.device), tf.name_scope("ps_slices_packed"):
      values = tf.concat([owns[p].values for p in group], axis=0)
      indices = tf.concat([tf.cast(owns[p].indices, tf.int64)
                           for p in group], axis=0)
      lengths = tf.stack([tf.shape(owns[p].values, out_type=tf.int64)[0]
                          for p in group])
    with tf.compat.v1.colocate_with(None, ignore_existing=True), \
        tf.device(device), tf.name_scope("ps_slices_unpacked"):
      for p, part_values, part_indices in zip(
          group, tf.split(values, lengths, num=len(group)),
          tf.split(indices, lengths, num=len(group))):
        arrived[p] = tf.IndexedSlices(part_values, part_indices,
                                      owns[p].dense_shape)
  return arrived


def gathered(cross, records: Sequence[Pending]) -> None:
  """Every task's slices of each record, gathered to every task in rank
  order: one device's, duplicates kept, since the user's code reads them
  (a global norm counts each slice)."""
  if not records:
    return
  pairs = cross.gather_slices([(r.local.values, r.local.indices)
                               for r in records])
  for record, (values, indices) in zip(records, pairs):
    stand_ins.connect(record.stand_in, tf.IndexedSlices(
        values, indices, record.local.dense_shape))


def _on_the_ps(stand_in: tf.IndexedSlices, device: str) -> None:
  """The stand-ins from the taken sum to the update, moved to the ps task
  with both, so that the sum does not travel to the chief and back."""
  stack = [stand_in.values, stand_in.indices]
  while stack:
    tensor = stack.pop()
    _tf.set_device(tensor.op, device)
    stack.extend(out for consumer in tensor.consumers()
                 if consumer.type == "PlaceholderWithDefault"
                 for out in consumer.outputs)
