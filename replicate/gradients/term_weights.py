"""Each tower's loss, weighted term by term as `loss_rule` reads it.

On groups: the losses weighed together are matched across towers by a key
(the k-th loss a tower's optimizer weighs; the spec's loss), and within it
term by term, by position. Tower 0 builds a stand-in for each term's total
over the towers (`replicate.gradients.stand_ins`), which `finish` connects
to the sum of every tower's value, summed across tasks in a synchronous
cluster in one call for all the group's totals.

On weights, per term of tower i:
- SUM: as it is (one device's loss is the towers' sum);
- MEAN: the sum of its elements over every tower's number of elements;
- RATIO `s / d`: `s` over every tower's `d` summed;
- ONCE: by the tower's share of the rows (the shares add up to 1), or with
  `Reduction.SUM` in the first tower only;
- STATED (a term not read, under an explicit `loss_reduction`): 1 for SUM,
  the tower's share for the averaging reductions.
"""

from typing import Any, Callable, Dict, List

import tensorflow as tf

from replicate.gradients import loss_rule
from replicate.gradients import stand_ins
from replicate.shard import sharding

Reduction = tf.compat.v1.losses.Reduction
# Reductions that say the loss averages over its rows, stated by the user.
# The default, SUM_BY_NONZERO_WEIGHTS, lets the graph decide; TensorFlow's
# SUM_OVER_NONZERO_WEIGHTS is the same string, so it does too.
_STATED_AVERAGES = (Reduction.MEAN, Reduction.SUM_OVER_BATCH_SIZE)
_TOTALED = (loss_rule.MEAN, loss_rule.RATIO)
# Per reduction, the terms a tower's one weight (`TowerWeights.of`: its
# share of the rows, 1 for SUM) weighs as the rule does.
FITS_ONE_WEIGHT = {
    reduction: frozenset([loss_rule.ONCE, loss_rule.STATED] + (
        [loss_rule.SUM] if reduction == Reduction.SUM else [loss_rule.MEAN]))
    for reduction in Reduction.all()}


class _Group:

  def __init__(self, kinds):
    self.kinds = kinds
    self.values: Dict[int, Dict[int, tf.Tensor]] = {}  # term -> tower -> v
    self.totals: Dict[int, tf.Tensor] = {}  # term -> stand-in
    self.finished = False


class TermWeights:
  """Weighs towers' losses term by term; see the module docstring."""

  def __init__(self, num_towers: int, shares: List[Any], has_rows: List[Any],
               reduction: str, is_first_task: bool,
               sum_over_tasks: Callable, row_counts=None):
    self._num_towers = num_towers
    self._shares = list(shares)
    self._has_rows = list(has_rows)
    self._reduction = reduction
    self._is_first_task = is_first_task
    self._sum_over_tasks = sum_over_tasks
    # Per tower, its static row count where it differs from the batch's
    # (a constant divisor equal to it is the tower's count of rows).
    self._row_counts = list(row_counts or [None] * num_towers)
    self._groups: Dict[Any, _Group] = {}
    self._kinds: Dict[Any, List[str]] = {}  # (key, tower) -> its terms
    self._readings: Dict[Any, loss_rule.Reading] = {}

  @property
  def reduction(self) -> str:
    return self._reduction

  def kinds_of(self, key, index: int) -> List[str]:
    """The kinds of the terms of the loss tower `index` weighed as `key`;
    a ratio over a count computed from shapes only (`tf.size`, Keras's and
    `tf.compat.v1.losses`' counts without row weights) is a mean."""
    reading = self._readings.get((key, index))
    if reading is None:
      return []
    return [loss_rule.MEAN if term.kind == loss_rule.RATIO and
            term.of_shapes else term.kind for term in reading.terms]

  def weigh(self, key, index: int, loss, depends,
            reaches_rows=None) -> tf.Tensor:
    """Tower `index`'s `loss`, each term weighted; `depends(t)`: whether
    `t` is computed from the tower's rows."""
    loss = tf.convert_to_tensor(loss)
    lenient = self._reduction != Reduction.SUM_BY_NONZERO_WEIGHTS
    try:
      reading = loss_rule.read(loss, depends, lenient=lenient,
                               reaches_rows=reaches_rows,
                               row_count=self._row_counts[index])
    except loss_rule.NotRead as e:
      raise ValueError(
          "replicate_model_fn cannot read how tower {}'s loss {!r} is "
          "reduced over its rows: the {} op {!r} is not read, as {}. Each "
          "tower's loss must be combined exactly as one device computes it "
          "on the whole batch. Fix: state what the loss divides by with "
          "replicate.loss_denominator(d) in the model_fn (d: the sum or "
          "count over the tower's rows, e.g. tf.reduce_sum(weights)), or, "
          "for a loss that sums over its rows, pass replicate_model_fn "
          "loss_reduction=tf.compat.v1.losses.Reduction.SUM.".format(
              index, loss.op.name, e.op.type, e.op.name, e.why)) from None
    self._check_reduction(reading)
    self._kinds[(key, index)] = reading.kinds()
    self._readings[(key, index)] = reading
    group = self._groups.get(key)
    if group is None:
      group = self._groups[key] = _Group(reading.kinds())
    elif group.kinds != reading.kinds():
      raise ValueError(
          "Tower {}'s loss {!r} has the terms {}, tower 0's {}: each "
          "tower's model_fn must compute its loss the same way, whatever "
          "its data.".format(index, loss.op.name, reading.kinds(),
                             group.kinds))
    if group.finished:
      raise ValueError("internal: a loss weighed after its group finished")
    parts = []
    with tf.name_scope("loss_terms"):
      for position, term in enumerate(reading.terms):
        parts.append(self._part(group, position, index, term))
      return reading.build(parts)

  def _part(self, group, position, index, term):
    kind = term.kind
    t = term.tensor
    if kind == loss_rule.SUM:
      return t
    if kind in (loss_rule.ONCE, loss_rule.STATED):
      weight = self._once_weight(index) if kind == loss_rule.ONCE else (
          1.0 if self._reduction == Reduction.SUM else self._shares[index])
      if isinstance(weight, float) and weight == 1.0:
        return t
      return t * sharding.weight_as(weight, t.dtype)
    if kind == loss_rule.MEAN:
      numerator = tf.reduce_sum(term.numerator)
      value = tf.size(term.numerator)
    else:
      numerator = term.numerator
      value = term.count
    value = tf.cast(value, tf.float32)
    if self._has_rows[index] is False:
      value = tf.zeros([], tf.float32)
    else:
      value = sharding.zero_unless_rows(value, self._has_rows[index])
    group.values.setdefault(position, {})[index] = value
    if position not in group.totals:
      group.totals[position] = stand_ins.stand_in(value, "term_total")
    return tf.math.divide_no_nan(
        numerator, tf.cast(group.totals[position], numerator.dtype))

  def _once_weight(self, index):
    if self._reduction == Reduction.SUM:
      return 1.0 if index == 0 and self._is_first_task else 0.0
    return self._shares[index]

  def _check_reduction(self, reading):
    kinds = reading.kinds()
    if self._reduction == Reduction.SUM:
      for term in reading.terms:
        if term.kind in _TOTALED:
          raise ValueError(
              "replicate_model_fn was given loss_reduction=Reduction.SUM, "
              "but the loss's term {!r} ({} op) is {}: summing the towers' "
              "losses as they are would not be one device's loss. Fix: "
              "leave loss_reduction at its default, which reads each term "
              "from the graph.".format(term.tensor.op.name,
                                       term.tensor.op.type, term.kind))
    elif self._reduction in _STATED_AVERAGES:
      if loss_rule.SUM in kinds and not any(k in _TOTALED for k in kinds):
        term = reading.terms[kinds.index(loss_rule.SUM)]
        raise ValueError(
            "replicate_model_fn was given loss_reduction={!r}, which "
            "averages, but the loss is a sum over rows (its term {!r}, a {} "
            "op, divides by nothing). Fix: loss_reduction=tf.compat.v1."
            "losses.Reduction.SUM, or leave it at its default, which reads "
            "each term from the graph.".format(
                self._reduction, term.tensor.op.name, term.tensor.op.type))

  def finish(self, key=None) -> None:
    """Connects each term's total: one group (`key`), or every group."""
    keys = [key] if key is not None else list(self._groups)
    for group_key in keys:
      group = self._groups.get(group_key)
      if group is None or group.finished:
        continue
      group.finished = True
      if not group.totals:
        continue
      positions = sorted(group.totals)
      sums = []
      for position in positions:
        values = group.values[position]
        # A tower that weighed no loss here made fewer optimizer calls:
        # refused where the calls are matched (`optimizer_calls`).
        sums.append(tf.math.add_n([values[i] for i in sorted(values)]))
      with tf.name_scope("loss_term_totals"):
        totals = self._sum_over_tasks(tf.stack(sums), "loss_terms_over_tasks")
        for position, total in zip(positions, tf.unstack(totals,
                                                         num=len(sums))):
          stand_ins.connect(group.totals[position], total)
