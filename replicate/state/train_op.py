"""The one `train_op` of a step, from the towers' `train_op`s.

On the update: tower 0's optimizer calls built the one update of the step
(see `replicate.gradients.apply_once`); every tower's call returned it.

On other state changes: `replicate.state.rule` classifies every stateful op a
tower's step runs, by the one rule for state; this module acts on the
classes. Tower 0's `train_op` runs as the `model_fn` built it. Of towers
1..N-1:
- `KEEP` changes run in every tower (added to the `train_op` where nothing
  else runs them), so an `assign_add` of the rows sums over the batch; a
  read the tower made after such a change (an accumulator read back for
  `apply_gradients`) waits for every tower's change, so it reads the
  batch's total;
- `ONCE` changes that the step runs anyway (a step counter the optimizer
  call waits for) are made to change nothing; the others are not run;
- `STATISTIC` writes: tower 0's writes the whole batch's value, and the
  other towers' are made to change nothing (`replicate.state.statistics`:
  by the loss's weights for a value computed from the loss, else by the
  towers' shares of the batch).

On towers without rows (a stand-in row): their `STATISTIC` values weigh 0,
and their `KEEP` writes are made to change nothing.

Editing built ops is kept to the inputs of write ops (a value, or an
ordering), in the fewest places (`replicate.state.write_edits`).
"""

import collections

import tensorflow as tf

from replicate import _tf
from replicate import graph_walk
from replicate.gradients import stand_ins
from replicate.state import op_kinds
from replicate.state import rule
from replicate.state import statistics
from replicate.state import write_edits

_KEEP, _ONCE, _STATISTIC = rule.KEEP, rule.ONCE, rule.STATISTIC


def combine_train_op(tower_specs, layout, progress, records,
                     variables, weights=None) -> tf.Operation:
  """Tower 0's train_op, the other towers' changes per class, the fold.

  `layout`, `progress` (the towers done), `records` (their optimizer calls),
  `variables` and `weights` (the loss's, a
  `replicate.gradients.weighting.TowerWeights`) are the build's pieces
  (see `replicate.towers.context`).
  """
  _check_optimizer_calls(records)
  classes = rule.classify(layout, progress, variables, tower_specs)
  if layout.spans_tasks:
    _check_over_tasks(classes, variables, progress.update_built)
    _after_the_check(classes, layout.cross_task.after_check)
  runs = set(graph_walk.ops_behind(
      [tower_specs[0].train_op] +
      [spec.loss for spec in tower_specs if spec.loss is not None],
      follow_control=True))
  statistics.combine(
      [[c for c in tower if c.kind == _STATISTIC] for tower in classes],
      layout, progress, tower_specs, weights)
  kept = []
  for tower in classes[1:]:
    for change in tower:
      if change.kind == _KEEP:
        kept.extend(_keep(change, layout, runs))
      elif change.kind == _ONCE and change.op in runs:
        _make_once(change, classes[0], runs)
  _wait_for_every_tower(classes, progress)
  train_op = tf.group(tower_specs[0].train_op, *kept,
                      name="train_op_over_towers")
  return variables.then_fold(train_op, layout.has_rows, layout.cross_task)


def _check_over_tasks(classes, variables, update_built):
  """Refuses what adds up over towers but not yet over a cluster's tasks.

  A `KEEP` change of shared state (an `assign_add` of the rows, a table
  insert) would add up each task's rows in its own copy only; a
  tower-local variable's is folded over the tasks. `TowerOptimizer`'s
  update (`update_built`) applies sums over every task already: an SGD
  step's scatter-add of sparse slices, on a task of one tower, is one.
  """
  for tower in classes:
    for change in tower:
      if change.op in update_built:
        continue
      if change.variable is not None and variables.is_tower_local(
          variables.tower0_variable(change.variable)):
        continue
      if change.kind == _KEEP and (change.is_shared or
                                   change.variable is None):
        if change.variable is None:
          raise ValueError(
              "The op {!r} ({}) changes a table or other state from the "
              "tower's rows. In a synchronous cluster every task keeps its "
              "own copy of that state, so each copy would hold only its "
              "task's rows. Fix: make the change outside the train_op (in "
              "the input_fn, or a hook), or train with ps tasks.".format(
                  change.op.name, change.op.type))
        raise ValueError(
            "The op {!r} ({}) adds to {!r} from the tower's rows. In a "
            "synchronous cluster every task keeps its own copy of that "
            "variable, so each copy would count only its task's rows. Fix: "
            "create the variable inside replicate.tower_local_scope("
            "'sum'), which adds up every task's part each step, or keep "
            "the count outside the train_op.".format(
                change.op.name, change.op.type, change.variable.op.name))


def _after_the_check(classes, check):
  """Every state change of the step waits for the end-of-input check.

  A change computed from no collective (a count of a static batch, which
  TensorFlow folds to a constant) would otherwise run in a step that then
  stops every task because an input ended, and count a batch no one
  trained on. Changes inside control flow wait with their enclosing op.
  """
  if check is None:
    return
  for tower in classes:
    for change in tower:
      op = change.op
      if change.kind == rule.ALLOWED:
        continue  # changes nothing that outlives the step (a handle, a read)
      if not (_tf.built_in_control_flow(op) or op.graph.building_function or
              check in op.control_inputs):
        _tf.add_control_input(op, check)


def _keep(change, layout, runs):
  """Tower i's change runs too; returns it if the step would not run it."""
  has_rows = layout.towers[change.tower].has_rows
  op = change.op
  if has_rows is False:
    if op in runs:
      write_edits.change_nothing(op, after=None)
    return []
  if not isinstance(has_rows, bool) and op.type not in op_kinds.IDEMPOTENT_TYPES:
    write_edits.change_nothing_unless_rows(op, has_rows, change.tower)
  return [] if op in runs else [op]


def _make_once(change, tower0_changes, runs):
  """A change of tower i that only tower 0's must make."""
  op = change.op
  if op.type not in op_kinds.WRITE_KINDS:
    raise ValueError(
        "Tower {}'s op {!r} ({}) is not computed from the tower's rows, so "
        "only tower 0's may run, but the tower's gradients or loss wait for "
        "it, so it would run once per tower. Fix: make it outside the "
        "model_fn's loss and optimizer call (e.g. group it with the "
        "train_op after the update), or make it depend on the tower's "
        "rows.".format(change.tower, op.name, op.type))
  tower0_writes = [c.op for c in tower0_changes
                   if c.variable is not None and
                   c.variable is change.variable and c.op in runs]
  # Not after a write of tower 0's that waits for this one already: an
  # accumulator of the whole batch's gradients, reset once the update ran,
  # where the update reads this tower's (zero) part, made after this add.
  tower0_writes = [write for write in tower0_writes if op not in set(
      graph_walk.ops_behind([write], follow_control=True))]
  write_edits.change_nothing(op, after=tower0_writes)



def _wait_for_every_tower(classes, progress) -> None:
  """Reads after a tower's `KEEP` change wait for every tower's.

  A gradient accumulator: each tower adds its gradients, then reads the
  accumulator back for `apply_gradients`; the read must see every tower's
  addition, the batch's total, as on one device.
  """
  writes = collections.defaultdict(list)  # variable op -> [(tower, op)]
  for tower in classes:
    for change in tower:
      if change.kind == _KEEP and change.is_shared:
        writes[change.variable.op].append((change.tower, change.op))
  writes = {variable_op: tower_writes
            for variable_op, tower_writes in writes.items()
            if len({tower for tower, _ in tower_writes}) > 1}
  # What some write waits for: only a read in there could make a cycle.
  behind_writes = set(graph_walk.ops_behind(
      [op for tower_writes in writes.values() for _, op in tower_writes],
      follow_control=True))
  tower_ops = [frozenset(ops) for ops in progress.tower_ops]
  for variable_op, tower_writes in writes.items():
    for index, ops in enumerate(tower_ops):
      own = {op for tower, op in tower_writes if tower == index}
      others = [op for tower, op in tower_writes if tower != index]
      for read in _reads_after(variable_op, own, ops):
        for write in others:
          if read in behind_writes and read in set(
              graph_walk.ops_behind([write], follow_control=True)):
            raise ValueError(
                "Tower {}'s op {!r} reads {!r} after adding to it, and "
                "another tower's addition {!r} waits for that read, so the "
                "read cannot see every tower's addition. Make the additions "
                "independent of the reads.".format(
                    index, read.name, variable_op.name, write.name))
          _tf.add_control_input(read, write)


def _reads_after(variable_op, own_writes, tower_ops):
  """The tower's reads of the variable that come after its own writes."""
  if not own_writes:
    return []
  reads = []
  for consumer in variable_op.outputs[0].consumers():
    if consumer not in tower_ops or consumer.type in op_kinds.WRITE_KINDS:
      continue
    behind = set(graph_walk.ops_behind([consumer], within=tower_ops,
                                   follow_control=True))
    if behind & own_writes:
      reads.append(consumer)
  return reads



def _check_optimizer_calls(records):
  counts = records.counts()
  if not any(counts):
    raise ValueError(
        "The model_fn built a train_op on {} towers without a "
        "TowerOptimizer, so each tower would update the variables with its "
        "own gradients. Please wrap optimizers with TowerOptimizer: "
        "replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(...)).".
        format(len(counts)))
  if len(set(counts)) > 1:
    raise ValueError(
        "The towers made different numbers of TowerOptimizer.apply_gradients "
        "calls ({}): each tower's model_fn was supposed to make the same "
        "optimizer calls in the same order. Make the calls independent of "
        "the tower's data.".format(", ".join(
            "tower {}: {}".format(i, n) for i, n in enumerate(counts))))
  for call in records.calls[0]:
    for pending, variable in call.stand_in_pairs or []:
      if pending is not None and not stand_ins.is_connected(pending):
        # Fail closed: unconnected, it passes tower 0's own gradient on.
        raise AssertionError(
            "replicate: the sum over towers of the gradient for {!r} was "
            "never built (a bug in replicate; please report it).".format(
                variable.op.name))
