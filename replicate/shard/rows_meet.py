"""Ops on the rows' path: refused where they combine rows, or are unknown.

On why: a tower computes on its shard. An op that combines rows of the
batch with each other (in-batch negatives `tf.matmul(a, b,
transpose_b=True)`, `top_k` over the batch, a cumulative sum or a
`tf.roll` down the batch, per-class sums keyed by the rows' labels) would
combine only the tower's shard's rows, and the result would be silently
unlike one device. Such an op on the path from the rows to the loss is
refused when the towers are built, naming the op and the fix,
`replicate.all_rows(tensor)` (with `replicate.row_offset()`), which gives
every tower the whole batch's rows. Off the loss's path (an op only
metrics, predictions or export outputs read), it is returned instead: what
is computed from it is built again on the whole batch's rows
(`replicate.outputs.whole_batch`), exact, with no fix to make.

On failing closed: every op type on that path must be known: either it
has a rule in `replicate.graph.row_rules` (refused in the patterns that
combine rows, passed otherwise, e.g. attention's batched matmuls within a
row; linear algebra on each row's own matrices), or
`replicate.graph.row_ops` knows it keeps rows apart (its docstring says how
that list was chosen). Any other type (a `py_func`, a custom op) is refused,
naming it, with the same fix: compute it on `all_rows(x)` and take the
tower's rows back. The functions that a TF 2 `tf.cond`, `tf.while_loop` or
`tf.function` on the path calls are looked into: each type there must be
known too (types with a rule pass there; their patterns need the outer
graph). Ops no output reads (summaries, the backward pass) are not
looked at.

On what is judged: tower 0's ops behind what the spec returns and computed
from its rows (`replicate.shard.rows`' rule), stopping at `all_rows`' values
(the whole batch's) and a candidate sampler's draws (random, not rows).
Reductions over the batch pass here: they are combined elsewhere.
"""

from typing import FrozenSet, Iterable, NamedTuple, Optional

import tensorflow as tf

from replicate import graph_walk
from replicate.graph import index_rules
from replicate.graph import op_types
from replicate.graph import row_facts
from replicate.graph import row_layout
from replicate.graph import row_ops
from replicate.graph import row_rules
from replicate.graph import declared
from replicate.shard import row_finder
from replicate.shard import rows as rows_lib


class Meeting(NamedTuple):
  """Tower 0's ops off the loss's path where rows meet (`check`'s)."""
  # Those that keep an axis of rows, which only metrics and outputs read:
  # a metric computed from one is computed on the whole batch's rows.
  for_metrics: FrozenSet[tf.Operation] = frozenset()
  # All of them: what is computed from one is built again on the whole
  # batch's rows, not put together from the towers' values.
  mixed: FrozenSet[tf.Operation] = frozenset()


def check(context, spec: tf.estimator.EstimatorSpec,
          whole_batch: Iterable[tf.Operation] = ()) -> Meeting:
  """Refuses an op of tower 0 on the path from its rows to `spec`'s loss
  that combines rows, or whose type is unknown (`_judged` says why); returns
  those off it, which metrics, predictions and export outputs read.

  `whole_batch`: ops whose values are the whole batch's (a
  `TPUEstimatorSpec`'s stand-ins for its `eval_metrics` tensors), where the
  walk from the rows stops, as at `all_rows`'s and at replicate's own ops.
  """
  message, meeting = _judged(context, spec, whole_batch)
  if message:
    raise ValueError(message)
  return meeting


def _judged(context, spec, whole_batch):
  """The refusal's message (or None), and the ops off the loss's path
  that would be refused on it: what is computed from them is the whole
  batch's only if computed on the whole batch's rows
  (`replicate.outputs.whole_batch`)."""
  combining, mixed = set(), set()
  if not context.layout.combines:
    return None, Meeting()
  tower = context.layout.towers[0]
  # Values replicate made the whole batch's: all_rows's, a TPUEstimatorSpec's
  # stand-ins, and every op it built itself (a batch-norm site's moments
  # gathered across tasks, in tower 0 when it is the task's one tower).
  stops = (set(context.all_rows.own_ops) | set(whole_batch) |
           set(context.progress.own_ops))
  tower_ops = [op for op in context.progress.tower_ops[0]
               if op not in stops and op.type not in op_types.SAMPLER_TYPES]
  within = frozenset(tower_ops)
  shard = (tower.features, tower.labels)
  rows = rows_lib.TowerRows(shard, within, inputs_of=_data_inputs)
  static_rows = _static_rows(context.layout.shards.sizes)
  finder = row_finder.Finder(
      rows, within, shard, static_rows,
      frozenset(context.progress.tower_ops[0]),
      row_layout.RowLayout(shard, within, rows.depend, static_rows))
  towers = context.layout.num_towers
  rules = row_rules.ROW_COMBINING
  known, library = len(row_ops.KEEPS_ROWS_APART) + len(rules), None
  off_path = _off_the_gradient_path(spec, within)
  for op in _judged_ops(spec, within):
    if declared.is_declared(op):
      continue  # the user declared it keeps rows apart (replicate.check)
    message = _why(op, rules, finder, rows, towers, known)
    if message is None and op.type in row_ops.CALLS and rows.depend([op]):
      if library is None:
        library = {f.signature.name: f
                   for f in op.graph.as_graph_def().library.function}
      inner = row_ops.unknown_in_calls(op, library, rules)
      if inner:
        message = _UNKNOWN.format(
            inner[0], "{!r} (inside the function {!r} calls)".format(
                inner[1], op.name), known, towers)
    if message is None:
      continue
    if not off_path(op):
      return message, Meeting()
    mixed.add(op)
    if any(finder.layout.fact(t).kind != row_facts.NONE and
           _may_hold_rows(t, static_rows) for t in op.outputs):
      # Its rows meet other rows (`a @ b^T`): a metric's per-row values
      # from it are the whole batch's only if computed on its rows. One
      # that reduces the rows away (a confusion matrix scattered by value,
      # Keras' cumulative sums over its 200 thresholds) is a sum or a
      # value over the batch: `replicate.outputs.metrics`'.
      combining.add(op)
  return None, Meeting(frozenset(combining), frozenset(mixed))


def _may_hold_rows(tensor, static_rows) -> bool:
  """Whether an axis of `tensor` may be the tower's rows: one of a size
  unknown when built, or of the tower's rows when known."""
  if tensor.shape.rank is None:
    return True
  return any(size is None or size == static_rows
             for size in tensor.shape.as_list())


def _why(op, rules, finder, rows, towers, known):
  """Why `op` would be refused on the path to the loss, or None (a call
  of functions is looked into by the caller)."""
  rule = rules.get(op.type)
  if rule is not None:
    why = rule(finder, op)
    if why:
      fix = _INDEX_FIX if op.type in index_rules.RULES else _FIX
      return _COMBINES.format(op.type, op.name, why, towers) + fix
  elif not row_ops.keeps_rows_apart(op.type) and rows.depend([op]):
    return _UNKNOWN.format(op.type, repr(op.name), known, towers)
  return None


_COMBINES = (
    "The {} op {!r} combines different rows of the batch ({}) on the path "
    "to the loss. On {} towers each tower would combine only its own "
    "shard's rows, and its gradients with them: silently unlike one "
    "device. ")
_FIX = (
    "Fix: give it the whole batch's rows with replicate.all_rows(tensor), "
    "and index rows of the batch with replicate.row_offset(), e.g. sim = "
    "tf.matmul(a, replicate.all_rows(b), transpose_b=True); labels = "
    "tf.range(tf.shape(a)[0]) + replicate.row_offset(). If it does keep "
    "rows apart, declare it: replicate.rows_apart(tensor), and verify with "
    "replicate.check.")
# An index op's indices are rows of the batch: they must count the whole
# batch's rows (a tower's row i is row_offset() + i there), and its output
# is the whole batch's, of which the tower takes its own rows back. Only
# the indexed input crosses the towers: the rest stays on the tower's rows.
_INDEX_FIX = (
    "Fix: index the whole batch's rows, gathered with "
    "replicate.all_rows(tensor) (indices of the tower's rows plus "
    "replicate.row_offset(), the whole batch's count "
    "tf.shape(replicate.all_rows(x))[0]), and take the tower's rows back, "
    "e.g. whole = replicate.all_rows(h); n = tf.shape(whole)[0]; y = "
    "tf.gather(whole, tf.range(n - 1, -1, -1))[replicate.row_offset():]"
    "[:tf.shape(h)[0]]. If it does keep rows apart, declare it: "
    "replicate.rows_apart(tensor), and verify with replicate.check.")
_UNKNOWN = (
    "The {} op {} is on the path from the tower's rows to the loss, and "
    "replicate cannot tell whether it keeps the batch's rows apart (it knows {} op types, listed in "
    "replicate/graph/row_ops.py and row_rules.py). On {} towers each tower "
    "would apply it to its own shard's rows only: if it combines rows, "
    "silently unlike one device. Fix: compute it on the whole batch and take "
    "the tower's rows back, e.g. y = my_op(replicate.all_rows(x))"
    "[replicate.row_offset():][:tf.shape(x)[0]]; or, if it keeps rows "
    "apart, declare it: replicate.rows_apart(tensor) or "
    "replicate.rows_apart('OpType'), and verify with replicate.check.")


def _off_the_gradient_path(spec, within):
  """A test of an op: whether the loss is not computed from it. There an
  op that combines rows, or that the rule does not know (a `py_func`
  corpus score, a median), is not refused: a metric, a prediction or an
  export output computed from it is computed once, on the whole batch's
  rows (`replicate.outputs.whole_batch`), and a metric fed per-row values
  sums them (as under TF 2, where a metric's writes are reached through
  control edges only, the same decision under TF 1)."""
  kept = set(graph_walk.ops_behind(
      [v for v in tf.nest.flatten(spec.loss, expand_composites=True)
       if isinstance(v, (tf.Tensor, tf.Operation))], within=within))
  return lambda op: op not in kept


def _data_inputs(op):
  """The inputs whose values reach the op's outputs: a TF 1 `Switch` passes
  its data on, not its predicate (a `tf.cond` on a sum of the rows does not
  make a variable it selects a value of the rows)."""
  if op.type in ("Switch", "RefSwitch"):
    return op.inputs[:1]
  return op.inputs


def _judged_ops(spec, within):
  """The ops the spec's outputs are computed from (data edges), then those
  only a metric's update reaches through control edges (under TF 2 its
  variables' writes are: what they add is the metric's too)."""
  seen = set()
  for op in graph_walk.ops_behind(_outputs_of(spec), within=within):
    seen.add(op)
    yield op
  metrics = [value for value in _outputs_of(spec, (spec.eval_metric_ops,))]
  for op in graph_walk.ops_behind(metrics, within=within,
                                  follow_control=True):
    if op not in seen:
      yield op


def _outputs_of(spec, values=None):
  if values is None:
    values = [spec.loss, spec.predictions, spec.eval_metric_ops,
              _export_tensors(spec)]
  for value in tf.nest.flatten(values, expand_composites=True):
    if isinstance(value, (tf.Tensor, tf.Operation)):
      yield value


def _export_tensors(spec):
  """The tensors of the spec's export outputs (every field they have)."""
  return [getattr(output, field, None)
          for output in (spec.export_outputs or {}).values()
          for field in ("outputs", "scores", "classes", "value")]


def _static_rows(sizes) -> Optional[int]:
  """Tower 0's rows when known at build time."""
  return sizes[0] if isinstance(sizes, list) else None
