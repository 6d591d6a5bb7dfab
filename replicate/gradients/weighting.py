"""How much each tower's loss counts, and `replicate.loss_denominator`.

On gradients: `replicate.gradients.gradient_weights` weights each gradient
a tower passes to `apply_gradients` once, by what this module says.

On weights: each tower's loss is weighted term by term as the graph says
it is reduced over the tower's rows (`replicate.gradients.loss_rule`, put
together by `replicate.gradients.term_weights`): a sum counts as it is, a
mean or a ratio of sums as the tower's sum over every tower's count, a term
not from the rows once. A loss the rule cannot read is refused with the
fix. A tower that states its denominator with `loss_denominator` is
weighted `d_i / sum_j d_j` as a whole instead, worked out at run time: the
explicit form wins over what the graph says. `TowerWeights.of` is the one
weight of a tower (its share `n_i / n`, 1 with `Reduction.SUM`, or
`d_i / sum_j d_j`), which gradients computed outside the optimizer get.

On towers whose denominator is 0 (every row padding): such a tower weighs
0, but its loss is 0 / 0 = NaN, and 0 x NaN is NaN, in the loss and in
every gradient. Weighing it 0 is not enough: it must not count at all, as
a tower without rows does not. `TowerWeights.counts` says, per tower,
whether its loss and gradients count; what a tower without rows has is
chosen away with `sharding.zero_unless_rows`, never multiplied by 0.
"""

from typing import Any, List, Optional, Set

import tensorflow as tf

from replicate.gradients import stand_ins
from replicate.gradients import term_weights
from replicate.shard import sharding
from replicate.call import current


def loss_denominator(denominator: Any) -> tf.Tensor:
  """States what this tower's loss is averaged over; returns it as a tensor.

  Args:
    denominator: a scalar: the count or sum the `model_fn`'s loss divides by
      (e.g. `tf.math.count_nonzero(weights)` for a
      `SUM_BY_NONZERO_WEIGHTS` loss, `tf.reduce_sum(weights)` for `MEAN`,
      `tf.reduce_sum(mask)` for a mean over the tokens a mask keeps).

  On towers: inside `replicate_model_fn`, with an averaging
  `loss_reduction`, tower i's loss (and so its gradients) is weighted by
  `d_i / sum_j d_j` as a whole, instead of term by term as the graph reads
  it, so that N towers train on the loss one device would compute on the
  whole batch. The graph is read without it for the usual forms
  (`tf.compat.v1.losses`, Keras losses, `reduce_sum(l * w) /
  reduce_sum(w)`); state it for a loss the rule refuses (e.g. one that
  divides by `tf.maximum(tf.reduce_sum(w), 1.0)`). Call it in the
  `model_fn` before the optimizer, once per tower. Outside
  `replicate_model_fn`, or with one tower, it does nothing.

  ```python
  def model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(features["x"], 3)
    weights = features["weight"]  # 0 for padding rows
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, weights=weights)  # SUM_BY_NONZERO_WEIGHTS
    replicate.loss_denominator(tf.math.count_nonzero(weights))
    ...
  ```
  """
  context = current.current_context()
  if (context is None or context.progress.tower_index is None or
      not context.layout.combines):
    return tf.convert_to_tensor(denominator)
  return context.weights.set_denominator(context.progress.tower_index,
                                         denominator)


class TowerWeights:
  """Each tower's loss weight, by rows or by stated denominators."""

  def __init__(self, weights: List[Any], has_rows: List[Any],
               sums_losses: bool, sum_over_tasks=lambda tensor, name: tensor,
               *, shares: Optional[List[Any]] = None,
               reduction: Optional[str] = None, is_first_task: bool = True,
               row_counts: Optional[List[Optional[int]]] = None):
    # In a synchronous cluster, the sum of a value over every task.
    self._sum_over_tasks = sum_over_tasks
    self._weights = list(weights)
    self._has_rows = has_rows
    self._sums_losses = sums_losses
    self._is_read = [False] * len(weights)
    self._denominators: List[Optional[tf.Tensor]] = [None] * len(weights)
    self._counts = list(has_rows)  # see `counts`
    self._total = None  # stand-in for sum_j d_j, connected by `finish`
    # Per tower, the ops holding its loss weight: a gradient computed
    # through one of them is already weighted (see `weighted_once`).
    self._weight_ops = [set() for _ in weights]
    # The loss rule (`replicate.gradients.loss_rule`): each tower's loss
    # weighted term by term, unless the tower stated its denominator.
    if reduction is None:
      reduction = (tf.compat.v1.losses.Reduction.SUM if sums_losses else
                   tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS)
    self._terms = term_weights.TermWeights(
        len(weights), list(weights) if shares is None else shares, has_rows,
        reduction, is_first_task, sum_over_tasks, row_counts)
    self._loss_calls = [0] * len(weights)
    self._weighed = {}  # (tower, loss) -> the loss weighted
    # Towers whose gradients, computed outside the optimizer, were scaled
    # by the tower's one weight (`weighted_once`).
    self._scaled = set()

  def note_scaled(self, index: int) -> None:
    """Tower `index`'s gradients were scaled by `of(index)` as they are."""
    self._scaled.add(index)

  def weigh_loss(self, index: int, loss, rows, key=None,
                 strict_rows=None) -> tf.Tensor:
    """Tower `index`'s `loss` weighted so that the towers' sum is one
    device's loss on the whole batch.

    By the denominator the tower stated (`loss_denominator`), or else term
    by term as the graph says (`replicate.gradients.term_weights`). `rows`:
    the tower's `replicate.shard.rows.TowerRows`. `key` matches the loss
    across towers; by default, the k-th loss the tower's optimizer weighs.
    """
    weight = self.of(index)
    loss = tf.convert_to_tensor(loss)
    if self._denominators[index] is not None:
      return loss * sharding.weight_as(weight, loss.dtype)
    if key is None:
      key = ("optimizer", self._loss_calls[index])
      self._loss_calls[index] += 1
    weighted = self._terms.weigh(
        key, index, loss, lambda t: rows.depend([t]),
        None if strict_rows is None else lambda t: strict_rows.depend([t]))
    self._weighed[(index, loss.ref())] = weighted
    return weighted

  def weigh_spec_losses(self, losses: List[Any], rows_of) -> List[tf.Tensor]:
    """Every tower's spec loss weighted (see `weigh_loss`): the tensor its
    optimizer weighed, if it is the same loss, else weighed here."""
    losses = [tf.convert_to_tensor(loss) for loss in losses]
    known = [self._weighed.get((i, loss.ref())) for i, loss in
             enumerate(losses)]
    if all(weighted is not None for weighted in known):
      return known
    result = [self.weigh_loss(i, loss, rows_of(i), key="spec",
                              strict_rows=rows_of(i, count_folded=False))
              for i, loss in enumerate(losses)]
    self._terms.finish("spec")
    for index in sorted(self._scaled):
      if self._denominators[index] is None:
        self._check_scaled(index, losses[index])
    return result

  def whole_batch_value(self, key, values: List[Any], rows_of) -> tf.Tensor:
    """The whole batch's value of a part of the loss (`values[i]`: tower
    i's; the loss itself, or a sum of its terms, as a moving average of it
    reads it), weighted as the loss is: by the stated denominators, or term
    by term as the graph reads it (`key` names the group of terms). Summed
    over the towers that count, and over tasks: the same in every tower."""
    weighted = [self.weigh_loss(i, value, rows_of(i), key=key,
                                strict_rows=rows_of(i, count_folded=False))
                for i, value in enumerate(values)]
    self._terms.finish(key)
    terms = [sharding.zero_unless_rows(value, counts)
             for value, counts in zip(weighted, self.counts())
             if counts is not False]
    return self._sum_over_tasks(tf.math.add_n(terms),
                                "statistic_over_tasks")

  def _check_scaled(self, index, loss):
    """Gradients scaled by the tower's one weight (its share of the rows,
    or 1 with `Reduction.SUM`) are right only for a loss every term of
    which that weight fits; else refused."""
    kinds = self._terms.kinds_of("spec", index)
    fits = term_weights.FITS_ONE_WEIGHT[self._terms.reduction]
    wrong = [kind for kind in kinds if kind not in fits]
    if wrong:
      raise ValueError(
          "Tower {} applies gradients it computed itself (tf.gradients or "
          "a GradientTape, not TowerOptimizer.compute_gradients or "
          "minimize), which can only be scaled by one weight per tower "
          "(its share of the rows, or 1 with Reduction.SUM), but its loss "
          "{!r} has a term that is {}, which that weight does not fit. Fix: "
          "take the gradients with TowerOptimizer.compute_gradients(loss), "
          "which weights each term of the loss as the graph reads it, or "
          "state what the loss divides by with "
          "replicate.loss_denominator(d).".format(
              index, loss.op.name, wrong[0]))

  def of(self, index: int):
    """Tower `index`'s weight (float or scalar tensor), now fixed."""
    self._is_read[index] = True
    return self._weights[index]

  def add_weight_op(self, index: int, op: tf.Operation) -> None:
    """`op` holds tower `index`'s weight, multiplied into its loss."""
    self._weight_ops[index].add(op)

  def weight_ops(self, index: int) -> Set[tf.Operation]:
    """The ops holding tower `index`'s weight (`add_weight_op`)."""
    return set(self._weight_ops[index])

  def all(self) -> List[Any]:
    return list(self._weights)

  def counts(self) -> List[Any]:
    """Per tower, whether its loss and gradients count (bool or bool tensor).

    A tower counts when it has rows and, if it stated a denominator, that
    denominator is not 0. Read once every tower stated its denominator:
    where the losses and gradients are combined.
    """
    return list(self._counts)

  def set_denominator(self, index: int, denominator) -> tf.Tensor:
    """Weights tower `index` by `denominator / sum over towers`."""
    if self._sums_losses:
      raise ValueError(
          "replicate.loss_denominator was called, but replicate_model_fn "
          "was given loss_reduction=Reduction.SUM, which sums the towers' "
          "losses as they are. A denominator only applies to a loss that "
          "averages: pass the reduction your loss uses (e.g. "
          "Reduction.SUM_BY_NONZERO_WEIGHTS, Reduction.MEAN), or remove the "
          "call.")
    if self._denominators[index] is not None:
      raise ValueError(
          "replicate.loss_denominator was called twice in tower {}: a "
          "tower's loss has one denominator. Call it once per model_fn "
          "call, with the denominator of the loss the optimizer "
          "minimizes.".format(index))
    if self._is_read[index]:
      raise ValueError(
          "replicate.loss_denominator was called in tower {} after the "
          "tower's loss was weighted (by TowerOptimizer's compute_gradients "
          "or minimize). Call it before the optimizer.".format(index))
    value = tf.convert_to_tensor(denominator)
    if value.shape.rank not in (None, 0):
      raise ValueError(
          "replicate.loss_denominator takes a scalar, the count or sum the "
          "tower's loss divides by. Received a tensor of shape {}: reduce "
          "it, e.g. tf.reduce_sum(weights).".format(value.shape))
    counted = sharding.zero_unless_rows(tf.cast(value, tf.float32),
                                        self._has_rows[index])
    if self._has_rows[index] is False:
      counted = tf.zeros([], tf.float32)
    self._denominators[index] = counted
    if self._has_rows[index] is not False:
      # `counted` is 0 on a step the tower has no rows: one test for both.
      self._counts[index] = tf.not_equal(counted, 0.0, name="tower_counts")
    if self._total is None:
      self._total = stand_ins.stand_in(counted, name="loss_denominator_total")
    self._weights[index] = tf.math.divide_no_nan(counted, self._total)
    return value

  def finish(self) -> None:
    """Connects the sums of the denominators and of the loss terms; every
    tower must state a denominator if one does."""
    if self._total is None:
      self._terms.finish()
      return
    missing = [i for i, d in enumerate(self._denominators) if d is None]
    if missing:
      raise ValueError(
          "replicate.loss_denominator was called in some towers but not in "
          "tower(s) {}: every tower's model_fn must state its loss "
          "denominator, whatever its data.".format(missing))
    self._terms.finish()
    with tf.name_scope("loss_denominator_over_towers"):
      stand_ins.connect(self._total, self._sum_over_tasks(
          tf.math.add_n(self._denominators), "loss_denominator_over_tasks"))
