"""The one rule for state: what each tower's step changes, and how it counts.

On the rule: every stateful op a tower's step runs (everything its
`train_op` and loss wait for, through data and control edges, also what the
towers' gradient sums pull in) falls in exactly one class:
- `ALLOWED`: it changes nothing that outlives the step (reads, variable
  handles, random numbers, asserts, prints, a tensor array's scratch);
- `KEEP`: every tower makes it, so the changes add up over the batch: an
  `assign_add` or scatter-add of a value computed from the tower's rows
  (`seen.assign_add(tf.size(x))`, a gradient accumulator), a variable
  declared `tf.VariableAggregation.SUM`, a table insert of keys from the
  rows, a write of the tower's own copy or of a variable it made itself;
- `ONCE`: tower 0's counts and the other towers' must change nothing: a
  change not computed from the rows (a step counter, `gs.assign(gs + 1)`, a
  constant, a copy of other variables), or a variable declared
  `ONLY_FIRST_REPLICA` (the global step);
- `STATISTIC`: the towers' values are combined into tower 0's write, the
  whole batch's (`replicate.state.statistics`: weighted as the loss is for
  a value of the loss, else by the towers' shares `n_i / n`): a variable
  declared `MEAN` (Keras batch norm's moving statistics), or an undeclared
  one written from the rows through `UPDATE_OPS` or a moving average
  (`AssignMovingAvg`);
- refused: anything else raises a `ValueError` that names the op, says why
  and gives the fix. Unknown means refused: nothing is dropped or repeated
  in silence.

"Computed from the rows" is `replicate.shard.rows`'s rule. This module only
classifies; `replicate.state.train_op` acts on the classes.
"""

from typing import Dict, List, NamedTuple, Optional

import tensorflow as tf

from replicate import graph_walk
from replicate.graph import op_types
from replicate.state import op_kinds
from replicate.shard import rows as rows_lib
from replicate import _tf

ALLOWED, KEEP, ONCE, STATISTIC = "allowed", "keep", "once", "statistic"

Aggregation = tf.VariableAggregation

class Change(NamedTuple):
  """A stateful op of one tower's step, and how it counts."""
  op: tf.Operation
  tower: int
  kind: str  # ALLOWED, KEEP, ONCE or STATISTIC
  variable: Optional[tf.Variable]  # the variable it writes, if it writes one
  # Whether that variable is shared with other towers (not a copy of the
  # tower's own, nor one it made for itself).
  is_shared: bool = False


def classify(layout, progress, variables,
             tower_specs) -> List[List[Change]]:
  """Per tower, its step's stateful ops, in build order, each classified.

  `layout` is the call's `replicate.call.layout.TowerLayout`, `progress`
  its `replicate.call.progress.BuildProgress` (the towers done: their
  ops, their `UPDATE_OPS`, replicate's own ops among them), `variables`
  its `replicate.variables.tower_variables.TowerVariables`.

  Raises the `ValueError` of the first op that can be neither combined nor
  made once.
  """
  closure = set(graph_walk.ops_behind(
      [spec.train_op for spec in tower_specs if spec.train_op is not None] +
      [spec.loss for spec in tower_specs if spec.loss is not None],
      follow_control=True))
  closure -= progress.own_ops
  by_op = _variables_by_op(layout.graph)
  classes = []
  for index in range(layout.num_towers):
    tower_ops = progress.tower_ops[index]
    in_step = [op for op in tower_ops if op in closure and
               _changes_state(op)]
    classifier = _Classifier(
        layout.towers[index], frozenset(tower_ops),
        progress.update_ops[index], variables, by_op)
    # A cluster's task of one tower has no tower 1 to refuse in its place:
    # tower 0's ops are refused as tower 1's would be, but for the update
    # TowerOptimizer built of the sums.
    strict = progress.update_built if layout.num_towers == 1 else None
    classes.append([classifier.change(op) if index else
                    classifier.tower0_change(op, strict) for op in in_step])
  return classes


class _Classifier:
  """Classifies the stateful ops of one tower."""

  def __init__(self, tower, tower_ops, update_ops, tower_variables,
               variables):
    self._index = tower.index
    self._tower_ops = tower_ops
    self._tower_variables = tower_variables  # a `TowerVariables`
    self._variables = variables  # variable op -> variable
    self.rows = rows_lib.TowerRows((tower.features, tower.labels), tower_ops)
    self._update_ops = set()
    for update in update_ops:
      self._update_ops.update(graph_walk.ops_behind([update], within=tower_ops,
                                                follow_control=True))

  def tower0_change(self, op, strict=None) -> Change:
    """Tower 0's ops run as built; only its statistic writes are sought.

    What would be refused in tower 0 is refused in tower 1, which made the
    same op. With `strict`, the ops of `TowerOptimizer`'s update (a
    synchronous cluster's task of one tower: no tower 1), it is refused
    here, but for those, which apply the sums over every tower.
    """
    try:
      return self.change(op)
    except ValueError:
      if strict is not None and op not in strict:
        raise
      return Change(op, 0, ALLOWED, None)

  def change(self, op) -> Change:
    if op.type in op_kinds.WRITE_KINDS or op.type in op_kinds.ADDITIVE_TYPES:
      variable = self._variables.get(written_op(op))
      kind = (self._write_kind(op, variable) if op.type in op_kinds.WRITE_KINDS else
              self._effect_kind(op))
      return Change(op, self._index, kind, variable, variable is not None
                    and not self._is_own(variable))
    return Change(op, self._index, self._effect_kind(op), None)

  def _write_kind(self, op, variable) -> str:
    if variable is None or self._is_own(variable):
      return KEEP
    aggregation = variable.aggregation
    kind = op_kinds.WRITE_KINDS[op.type]
    # A folded `zeros_like(v)` or `ones_like(v)` written as it is, is a
    # constant of the variable's shape (an accumulator's reset), whatever
    # shape it was folded from.
    from_rows = (not _is_constant(op.inputs[1]) and
                 self.rows.depend([op.inputs[1]]))
    if aggregation == Aggregation.ONLY_FIRST_REPLICA:
      return ONCE
    if aggregation == Aggregation.MEAN:
      return STATISTIC
    if aggregation == Aggregation.SUM:
      if kind == "set":
        raise _refusal(self._index, op, variable, (
            "is declared aggregation=SUM, but the tower assigns it, and the "
            "towers' assignments do not add up"),
                       "write it with assign_add (each tower adds its part)")
      return KEEP
    if not from_rows:
      return ONCE
    if op in self._update_ops or _is_moving_average(op):
      return STATISTIC
    if kind == "set":
      raise _refusal(self._index, op, variable, (
          "is assigned a value computed from the tower's rows, and with "
          "no declared aggregation replicate cannot tell how the towers' "
          "values make the batch's"), (
              "declare the variable's aggregation: "
              "aggregation=tf.VariableAggregation.MEAN for a mean or "
              "statistic (combined by each tower's share of the batch), or "
              "write a count with assign_add; or add the update to "
              "UPDATE_OPS, or create the variable in "
              "replicate.tower_local_scope"))
    return KEEP

  def _effect_kind(self, op) -> str:
    if op.type in op_kinds.ALLOWED_TYPES:
      return ALLOWED
    if op.type in op_types.PY_FUNC_TYPES and any(
        output.consumers() for output in op.outputs):
      return ALLOWED  # a computation on the tower's rows, like a map
    variable = self._variables.get(written_op(op)) if op.inputs else None
    from_rows = self.rows.depend([op])
    if op.type in op_kinds.ADDITIVE_TYPES:
      if variable is not None and (
          self._is_own(variable) or
          variable.aggregation == Aggregation.SUM):
        return KEEP
      if variable is not None and variable.aggregation != Aggregation.NONE:
        raise _refusal(self._index, op, variable, (
            "is declared aggregation={} but is changed with {}".format(
                variable.aggregation.name, op.type)),
                       "update it with assign, assign_add or assign_sub")
      return KEEP if from_rows else ONCE
    if op.type in op_kinds.TABLE_UNION_TYPES:
      if written_op(op) in self._tower_ops and self._index:
        raise _refusal(self._index, op, None, (
            "changes a table the tower created itself: each tower would "
            "fill its own table with its own rows, and tower 0's, the one "
            "read, would hold part of the batch"), (
                "create the table once per graph and use it in every tower "
                "(e.g. keep it in a dict keyed by "
                "tf.compat.v1.get_default_graph() in the model_fn's "
                "closure), so every tower's inserts reach one table"))
      return KEEP if from_rows else ONCE
    if op.type in op_kinds.REPLACING_TYPES:
      if variable is not None and self._is_own(variable):
        return KEEP
      if not from_rows:
        return ONCE
      raise _refusal(self._index, op, variable, (
          "replaces elements with values computed from the tower's rows "
          "({}), and the towers' replacements can collide".format(op.type)),
                     "create the variable in replicate.tower_local_scope, or "
                     "make the update outside the train_op")
    calls = _tf.called_functions(op)
    if calls is not None:
      return self._call_kind(op, calls, from_rows)
    if op.type.startswith(("Apply", "ResourceApply", "SparseApply",
                           "ResourceSparseApply")):
      raise _refusal(self._index, op, None, (
          "is an optimizer update made by the tower itself"), (
              "wrap every optimizer in replicate.TowerOptimizer, whose "
              "update is made once for all towers"))
    raise _refusal(self._index, op, None, (
        "is a stateful {} that replicate does not know how to combine "
        "over towers".format(op.type)), (
            "build it outside the train_op (in a hook or the input_fn), or "
            "make it depend on tower 0 only"))

  def _call_kind(self, op, function_types, from_rows) -> str:
    """A function call (`tf.function`, TF 2 `tf.cond`/`tf.while_loop`)."""
    stateful = {t for t in function_types
                if t not in op_kinds.ALLOWED_TYPES and
                t not in op_types.PY_FUNC_TYPES}
    if not stateful:
      return ALLOWED
    declared = [self._variables.get(t.op) for t in op.inputs
                if t.dtype == tf.resource]
    declared = [v for v in declared if v is not None and not self._is_own(v)
                and v.aggregation not in (Aggregation.NONE, Aggregation.SUM)]
    if stateful <= {"AssignAddVariableOp", "AssignSubVariableOp"} and (
        not declared):
      return KEEP if from_rows else ONCE
    raise _refusal(self._index, op, None, (
        "calls a function (a tf.function, or a TF 2 tf.cond or "
        "tf.while_loop) that changes state with {}; replicate combines "
        "only additions (assign_add) made inside a function".format(
            ", ".join(sorted(stateful)))), (
                "make the change outside the function (return the new value "
                "and assign it in the model_fn), where the one rule for "
                "state applies; for batch norm, pass a Python bool as "
                "training"))

  def _is_own(self, variable) -> bool:
    """A copy of the tower's, or a variable the tower made for itself."""
    variables = self._tower_variables
    return (variable.op in variables.copy_ops(self._index) or
            (variable.op in self._tower_ops and
             not variables.is_shared(variable)))


def _changes_state(op) -> bool:
  """Stateful by TensorFlow's registry, or a write through a ref.

  A TF 1 (ref) variable's `Assign`, `AssignSub`, `ScatterAdd`, ... and its
  optimizers' `Apply*` are not registered stateful (they change the state
  their ref input points to), but change it all the same.
  """
  return (_tf.is_stateful(op) or op.type in op_kinds.WRITE_KINDS or
          op.type in op_kinds.ADDITIVE_TYPES or op.type in op_kinds.REPLACING_TYPES or
          op.type.startswith(("Apply", "SparseApply")))


def written_op(write_op):
  """The op of the variable a write op writes (through control flow's)."""
  op = write_op.inputs[0].op
  while op.type in op_kinds.PASSING_TYPES and op.inputs:
    op = op.inputs[0].op
  return op


def _variables_by_op(graph) -> Dict[tf.Operation, tf.Variable]:
  found = {}
  for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
              tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
              tf.compat.v1.GraphKeys.METRIC_VARIABLES):
    for variable in graph.get_collection(key):
      found.setdefault(variable.op, variable)
  return found


def _is_constant(tensor) -> bool:
  """A constant that holds no count: not a folded `Size` or `Shape`."""
  name = tensor.op.name.split("/")[-1]
  return tensor.op.type == "Const" and not name.startswith(("Size", "Shape"))


def _is_moving_average(op) -> bool:
  return any(part == "AssignMovingAvg" or part.startswith("AssignMovingAvg_")
             for part in op.name.split("/"))


def _refusal(index, op, variable, why, fix) -> ValueError:
  target = "" if variable is None else " writes {!r}, which".format(
      variable.op.name)
  subject = "{!r}{}".format(op.name, target)
  if not target:
    subject += ","
  return ValueError(
      "Tower {}'s op {} {}. Each tower (and, in a synchronous cluster, "
      "each task) runs it on its own rows, and replicate_model_fn cannot "
      "make that equal to one device on the whole batch. Fix: "
      "{}.".format(index, subject, why, fix))
