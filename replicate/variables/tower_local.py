"""Tower-local variables: one copy per tower, folded into tower 0's each step.

On tower-local variables: inside `tower_local_scope(reduce)` every tower
gets its own copy of a variable (under any `variable_strategy`), starting
from tower 0's value, and updates it with no communication. At the end of
each training step (and of each evaluation batch) the copies are folded
into tower 0's variable, the one that is saved: `"sum"` adds to it what
every other tower added since the last fold; `"mean"` sets it to the mean
over the towers that had rows. Then every copy starts again from tower 0's
value. So every tower reads the reduction as of the last fold, plus its own
updates since.

The copies themselves are made by `replicate.variables.tower_variables.TowerVariables`, as
for `"replicated"`; this module is the scope that marks the variables and
the fold.
"""

import contextlib

import tensorflow as tf

from replicate.call import current
from replicate.shard import sharding

SUM = "sum"
MEAN = "mean"
REDUCTIONS = (SUM, MEAN)


@contextlib.contextmanager
def tower_local_scope(reduce: str = SUM):
  """Variables created inside get one copy per tower, reduced when read.

  Args:
    reduce: `"sum"` (e.g. an examples-seen counter: each tower counts its
      rows, the saved value is the total) or `"mean"` (e.g. a running
      statistic: the saved value is the mean over towers).

  On use: variables created in the scope must not be trainable; each tower
  updates its own copy in its `train_op` (or its metric update ops), and
  after every training step tower 0's variable, the one that is saved,
  evaluated and exported, holds the reduction. Outside `replicate_model_fn`,
  or with one tower, the scope does nothing.

  ```python
  def model_fn(features, labels, mode):
    with replicate.tower_local_scope(reduce="sum"):
      seen = tf.compat.v1.get_variable(
          "examples_seen", [], tf.int64, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
    count = seen.assign_add(tf.shape(labels, out_type=tf.int64)[0])
    ...
    train_op = tf.group(optimizer.minimize(loss, global_step), count)
  ```
  """
  if reduce not in REDUCTIONS:
    raise ValueError(
        "tower_local_scope(reduce=...) must be one of {}. Received: "
        "{!r}.".format(", ".join(repr(r) for r in REDUCTIONS), reduce))
  context = current.current_context()
  if (context is None or context.progress.tower_index is None or
      not context.layout.combines):
    yield
    return
  previous = context.variables.local_reduce
  context.variables.local_reduce = reduce
  try:
    yield
  finally:
    context.variables.local_reduce = previous


def fold(variable, reduce: str, per_tower, has_rows, base=None,
         cross_task=None) -> tf.Operation:
  """Folds the towers' copies of `variable` into it, per `reduce`.

  `per_tower` holds tower 0's variable, then each tower's copy or None;
  `base`, for `"sum"` only, the value every copy started from. With
  `cross_task` (a `replicate.cluster.sync_cluster.CrossTask`), over every
  task's towers.
  """
  with tf.device(variable.device), tf.name_scope(
      variable.op.name + "_over_towers"):
    if reduce == SUM:
      return _fold_sum(variable, per_tower, has_rows, base, cross_task)
    return _fold_mean(variable, per_tower, has_rows, cross_task)


def _fold_sum(variable, per_tower, has_rows, base, cross_task):
  """tower 0 += what every other tower added since the last fold.

  Every copy started the step at `base`; the towers that had rows add
  their copy less the base to tower 0's variable, and then every copy and
  the base start again from the new total. Across tasks, each task's
  additions (its tower 0's too) are summed over the tasks and added to the
  base.
  """
  copies = [c for c in per_tower[1:] if c is not None]
  start = base.read_value()
  added = [sharding.zero_unless_rows(c.read_value() - start, rows)
           for c, rows in zip(per_tower[1:], has_rows[1:])
           if c is not None and rows is not False]
  if cross_task is not None:
    local = tf.math.add_n([variable.read_value() - start] + added)
    summed = cross_task.sum(local, name="tower_local_sum_over_tasks")
    total = variable.assign(start + summed, read_value=True)
  elif added:
    with tf.control_dependencies(added):
      total = variable.assign_add(tf.math.add_n(added), read_value=True)
  else:
    total = variable.read_value()
  return tf.group(*[c.assign(total) for c in copies + [base]])


def _fold_mean(variable, per_tower, has_rows, cross_task):
  """tower 0 and every copy = the mean over towers with rows."""
  values, counts = [], []
  for copy, rows in zip(per_tower, has_rows):
    if copy is None or rows is False:
      continue
    values.append(sharding.zero_unless_rows(copy.read_value(), rows))
    counts.append(tf.cast(rows, variable.dtype.base_dtype))
  value_sum, count_sum = tf.math.add_n(values), tf.math.add_n(counts)
  if cross_task is not None:
    value_sum, count_sum = cross_task.sum_all(
        [value_sum, count_sum], name="tower_local_mean_over_tasks")
  mean = tf.math.divide_no_nan(value_sum, count_sum)
  return tf.group(*[c.assign(mean) for c in per_tower if c is not None])
