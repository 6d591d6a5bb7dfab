"""The checks of `replicate_model_fn`'s arguments: those made when it is
called (`check_all`), and those of the Estimator's, per call of the wrapped
`model_fn` (`model_fn_kwargs`, `is_export_graph`).

Each raises a `ValueError` that says what was received and what to pass.
"""

import tensorflow as tf

from replicate import _tf
from replicate import canned
from replicate import graph_walk
from replicate.call import devices as devices_lib
from replicate.communication import allreduce
from replicate.variables import strategies

Reduction = tf.compat.v1.losses.Reduction

# Ops that feed an input pipeline's batches; features that come from these
# are training or prediction input, not a serving signature's placeholders.
_PIPELINE_OP_TYPES = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2",
    "QueueDequeueUpTo", "QueueDequeueUpToV2"
])
_PLACEHOLDER_OP_TYPES = frozenset(["Placeholder", "PlaceholderWithDefault"])


def check_all(model_fn, loss_reduction, devices, variable_strategy,
              sync_batch_norm, all_reduce, compact_gradients):
  """Every check of `replicate_model_fn`'s arguments, made when wrapping.

  Args:
    model_fn, loss_reduction, devices, variable_strategy, sync_batch_norm,
      all_reduce, compact_gradients: `replicate_model_fn`'s arguments.

  Returns:
    (the devices normalized, or None for every local device; the names of
    the `model_fn`'s arguments).

  Raises:
    ValueError: the first argument that is wrong, with what to pass.
  """
  check_loss_reduction(loss_reduction)
  fixed_devices = devices_lib.normalize_devices(devices)
  check_variable_strategy(variable_strategy)
  check_all_reduce(all_reduce, compact_gradients, variable_strategy)
  canned.check_canned_model_fn(model_fn, loss_reduction)
  model_fn_args = _tf.fn_args(model_fn)
  check_takes_features(model_fn, model_fn_args)
  check_sync_batch_norm(sync_batch_norm)
  return fixed_devices, model_fn_args


def check_loss_reduction(loss_reduction):
  if loss_reduction == Reduction.NONE:
    raise ValueError(
        "loss_reduction=Reduction.NONE: a none reduction is specified, but "
        "each tower's loss must be a scalar to be weighted and summed. Use "
        "Reduction.SUM or Reduction.SUM_BY_NONZERO_WEIGHTS (the default) to "
        "match how the model_fn reduces its loss.")
  if loss_reduction not in Reduction.all():
    raise ValueError(
        "loss_reduction must be one of {}. Received: {!r}.".format(
            sorted(set(Reduction.all()) - {Reduction.NONE}), loss_reduction))


def check_variable_strategy(variable_strategy):
  if variable_strategy not in strategies.NAMES:
    raise ValueError(
        "variable_strategy must be one of {}. Received: {!r}.".format(
            ", ".join(repr(s) for s in strategies.NAMES), variable_strategy))


def check_all_reduce(all_reduce, compact_gradients, variable_strategy):
  allreduce.check_algorithm(all_reduce)
  if not isinstance(compact_gradients, bool):
    raise ValueError(
        "compact_gradients must be True or False. Received: {!r}.".format(
            compact_gradients))
  if variable_strategy != strategies.REPLICATED and (
      all_reduce != allreduce.AUTO or compact_gradients):
    raise ValueError(
        "all_reduce={!r} and compact_gradients={!r} choose how replicated "
        "towers sum their gradients; they apply only with "
        "variable_strategy='replicated' (received {!r}). Pass "
        "variable_strategy='replicated', or leave them at their defaults."
        .format(all_reduce, compact_gradients, variable_strategy))


def check_takes_features(model_fn, model_fn_args):
  """The Estimator passes features by keyword, so the model_fn must name it."""
  if "features" not in model_fn_args:
    raise ValueError(
        "The model_fn {!r} takes no argument named features (it takes {}); "
        "the Estimator, and replicate_model_fn like it, passes every "
        "argument by keyword. Name the model_fn's first argument features."
        .format(model_fn, ", ".join(model_fn_args) or "none"))


def check_sync_batch_norm(sync_batch_norm):
  if not isinstance(sync_batch_norm, bool):
    raise ValueError(
        "sync_batch_norm must be True (the default: batch norm in training "
        "mode normalizes with the whole batch's moments) or False (each "
        "tower's own rows). Received: {!r}.".format(sync_batch_norm))


def model_fn_kwargs(model_fn, model_fn_args, labels, mode, params, config):
  """The keyword arguments the Estimator would pass, checked the same way.

  Everything, features included, goes by keyword, so the model_fn's
  parameters may come in any order, as the Estimator allows.
  """
  kwargs = {}
  if "mode" in model_fn_args:
    kwargs["mode"] = mode
  if "labels" in model_fn_args:
    kwargs["labels"] = labels
  elif labels is not None:
    raise ValueError(
        "The model_fn {!r} does not take labels, but the input_fn returns "
        "labels. Add a labels argument to the model_fn or return features "
        "only.".format(model_fn))
  if "params" in model_fn_args:
    kwargs["params"] = params
  elif params:
    raise ValueError(
        "The model_fn {!r} does not take params, but params {!r} were given "
        "to the Estimator. Add a params argument to the model_fn.".format(
            model_fn, params))
  if "config" in model_fn_args:
    kwargs["config"] = config
  return kwargs


def is_export_graph(mode, features):
  """Whether the graph is a SavedModel's, to build as one unplaced tower.

  A serving graph is PREDICT with features fed by placeholders. The TRAIN
  and EVAL graphs of `experimental_export_all_saved_models` are fed by
  placeholders too, but so is training through a `FeedFnHook` (and a
  model_fn called by hand), which must keep its towers: for those modes the
  Estimator's export method is recognised among the callers.
  """
  if mode == tf.estimator.ModeKeys.PREDICT and _is_serving_input(features):
    return True
  return _tf.in_saved_model_export()


def _is_serving_input(features):
  """Whether features come from placeholders rather than an input pipeline."""
  has_placeholder = False
  for op in graph_walk.ops_behind(
      t for t in tf.nest.flatten(features, expand_composites=True)
      if isinstance(t, tf.Tensor)):
    if op.type in _PIPELINE_OP_TYPES:
      return False
    has_placeholder = has_placeholder or op.type in _PLACEHOLDER_OP_TYPES
  return has_placeholder
