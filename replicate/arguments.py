"""The checks of `replicate_model_fn`'s arguments, made when it is called.

Each raises a `ValueError` that says what was received and what to pass.
"""

import tensorflow as tf

from replicate.communication import allreduce
from replicate.variables import strategies

Reduction = tf.compat.v1.losses.Reduction


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
