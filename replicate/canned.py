"""Checks for the `model_fn` of a canned estimator, made when wrapping.

On canned estimators: `estimator.model_fn` of a canned estimator
(`tf.estimator.DNNClassifier`, `tf.compat.v1.estimator.LinearRegressor`, ...)
can be wrapped like any `model_fn`. Two things would go wrong silently, so
they are refused with an error that says what to do instead:
- an estimator that is not trained by gradients through an optimizer
  (k-means, boosted trees) cannot have its batches split across towers;
- a stated `loss_reduction` unlike the head's (`Reduction.SUM` for a head
  that averages, `MEAN` for one that sums, as every
  `tf.compat.v1.estimator` canned estimator does by default) would weight
  each tower's loss wrongly. The default, `SUM_BY_NONZERO_WEIGHTS`, reads
  the loss from the graph (`replicate.gradients.loss_rule`), a head's sum
  as a sum and its mean as a mean, so it is right for every head;
- a v1 head with a `weight_column` that divides by the weights (`MEAN`,
  `SUM_BY_NONZERO_WEIGHTS`) cannot be reproduced from the towers' losses.
These look into the estimator's `model_fn` closure: TensorFlow has no public
way to get from a `model_fn` to its estimator and head. The estimator is
also found behind what users wrap `estimator.model_fn` in: a
`functools.partial`, a `functools.wraps`-style wrapper (`__wrapped__`), a
function that calls it (closures of closures, or an estimator the function
names as a module global), a few levels deep.
"""

import functools
from typing import Any, Callable, Iterator, Optional

import tensorflow as tf

from replicate import _tf

Reduction = tf.compat.v1.losses.Reduction

_NOT_GRADIENT_BASED = ("BoostedTrees", "KMeans")
_SUM_REDUCTIONS = frozenset([Reduction.SUM, tf.keras.losses.Reduction.SUM])
# Reductions that divide by the rows' weights (a v1 head with a weight
# column): not reproducible from per-tower losses without their weights.
_WEIGHT_DIVIDED = frozenset([Reduction.MEAN, Reduction.SUM_BY_NONZERO_WEIGHTS])
# How many wrappers deep the estimator is looked for: enough for a partial
# of a decorated closure, bounded so a large object graph is not walked.
_MAX_DEPTH = 4


def check_canned_model_fn(model_fn: Callable, loss_reduction: str) -> None:
  """Raises if `model_fn` is a canned estimator's that towers would break."""
  estimator = _find_estimator(model_fn)
  if estimator is None:
    return
  name = type(estimator).__name__
  if name.startswith(_NOT_GRADIENT_BASED):
    raise ValueError(
        "{} is not trained by gradients through an optimizer, so "
        "replicate_model_fn cannot split its batches across towers. Train "
        "it with its own model_fn, unwrapped.".format(name))
  head = _closure_value(_tf.estimator_model_fn(estimator), _tf.is_head)
  if head is None:
    return
  head_reduction = _tf.head_loss_reduction(head)
  reads_graph = loss_reduction == Reduction.SUM_BY_NONZERO_WEIGHTS
  if not reads_graph and (head_reduction in _SUM_REDUCTIONS) != (
      loss_reduction == Reduction.SUM):
    wanted = ("tf.compat.v1.losses.Reduction.SUM"
              if head_reduction in _SUM_REDUCTIONS else
              "tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS (the "
              "default)")
    raise ValueError(
        "The {} head reduces its loss with {!r}, but replicate_model_fn was "
        "given loss_reduction={!r}, which would weight each tower's loss "
        "wrongly. Pass loss_reduction={}.".format(name, head_reduction,
                                                  loss_reduction, wanted))
  weight_column = _tf.head_weight_column(head)
  if weight_column is not None and head_reduction in _WEIGHT_DIVIDED:
    raise ValueError(
        "The {} head has weight_column={!r} and loss_reduction={!r}: it "
        "divides the loss by the weights of the rows it sees, so each tower "
        "would divide by its own shard's weights, not the batch's. Give the "
        "estimator loss_reduction=tf.compat.v1.losses.Reduction.SUM (and "
        "replicate_model_fn loss_reduction=Reduction.SUM), or "
        "Reduction.SUM_OVER_BATCH_SIZE (and the default loss_reduction "
        "here), which towers reproduce exactly.".format(
            name, getattr(weight_column, "key", weight_column),
            head_reduction))


def _find_estimator(model_fn: Callable) -> Any:
  """The canned estimator behind `model_fn` and its wrappers, or None."""
  seen = set()
  pending = [(model_fn, 0)]
  while pending:
    value, depth = pending.pop(0)  # breadth first: the nearest one wins
    if id(value) in seen:
      continue
    seen.add(id(value))
    if _is_estimator(value):
      return value
    if depth < _MAX_DEPTH and callable(value):
      pending.extend((inner, depth + 1) for inner in _wrapped_values(value))
  return None


def _wrapped_values(function: Callable) -> Iterator[Any]:
  """What `function` may wrap: a partial's parts, `__wrapped__`, a bound
  method's object, its closure, and the module globals its code names."""
  if isinstance(function, functools.partial):
    yield function.func
    yield from function.args
    yield from (function.keywords or {}).values()
  wrapped = getattr(function, "__wrapped__", None)
  if wrapped is not None:
    yield wrapped
  owner = getattr(function, "__self__", None)
  if owner is not None:
    yield owner
  yield from _cell_values(function)
  code = getattr(function, "__code__", None)
  names = getattr(function, "__globals__", None)
  if code is not None and names is not None:
    yield from (names[name] for name in code.co_names if name in names)


def _cell_values(function: Optional[Callable]) -> Iterator[Any]:
  for cell in getattr(function, "__closure__", None) or ():
    try:
      yield cell.cell_contents
    except ValueError:  # an empty cell
      continue


def _closure_value(function: Optional[Callable],
                   predicate: Callable[[Any], bool]) -> Any:
  return next((value for value in _cell_values(function) if predicate(value)),
              None)


def _is_estimator(value) -> bool:
  return isinstance(value, (tf.estimator.Estimator,
                            tf.compat.v1.estimator.Estimator))

