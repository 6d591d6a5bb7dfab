"""Summaries and logged tensors of values over the batch: the whole batch's.

On what: tower 0's summary ops (`tf.compat.v1.summary.*`, and TF 2's
`tf.summary.*` write ops, directly or inside the `cond` of a
`tf.summary.record_if`) and the tensors of the spec's `LoggingTensorHook`s
(training, evaluation and prediction hooks; tensors given as tensors or by
name). The unwrapped `model_fn` builds them once, on the whole batch; the
wrapper keeps tower 0's (towers 1..N-1's summaries are dropped, see
`replicate.towers.context`), which read tower 0's shard. Each value they
read that is over the batch (no axis of rows, computed from the rows: the
loss, a term of it, a reduction over the rows, a count `tf.shape(x)[0]`, a
metric's update in TRAIN) is read instead as the whole batch's, built by
`replicate.outputs.whole_batch`. Only the readers are re-pointed: the
loss's path, the gradients and the predictions keep the tower's values,
and nothing more is computed unless a summary or a hook reads it (the
Estimator's summary steps).

What stays tower 0's: a per-row tensor itself (a histogram of the logits:
one summary op has one input, and the rows it shows are tower 0's shard),
and what `whole_batch` cannot build again (see there: a value whose rows
the row analysis lost before a dropout's draw).
"""

import copy
from typing import Dict, Optional

import tensorflow as tf

from replicate import _tf

# Which input of each summary op is the value it shows: v1 ops, then TF 2's.
SUMMARY_INPUTS = {
    "ScalarSummary": 1, "HistogramSummary": 1, "ImageSummary": 1,
    "AudioSummary": 1, "AudioSummaryV2": 1, "TensorSummary": 0,
    "TensorSummaryV2": 1, "WriteSummary": 2, "WriteScalarSummary": 3,
    "WriteHistogramSummary": 3, "WriteImageSummary": 3,
    "WriteAudioSummary": 3}
_HOOK_FIELDS = ("training_hooks", "evaluation_hooks", "prediction_hooks")
_CONDS = frozenset(["If", "StatelessIf"])
_CAPTURES = frozenset(["Switch", "RefSwitch", "Identity"])


def make_whole(tower_specs, *, layout, progress, whole) -> Dict[str, list]:
  """Re-points tower 0's summaries and logged tensors of values over the
  batch at the whole batch's values (see the module's docstring).

  Returns the spec's hook fields whose `LoggingTensorHook`s log the whole
  batch's values instead: {field: its hooks}, for the combined spec.

  `whole()`: the call's `replicate.outputs.whole_batch.WholeBatch`.
  """
  if not layout.combines:
    return {}
  spec = tower_specs[0]
  reads = _summary_reads(progress.tower_ops[0])
  hooks = {field: list(getattr(spec, field) or ()) for field in _HOOK_FIELDS}
  if not reads and not any(
      isinstance(hook, tf.compat.v1.train.LoggingTensorHook)
      for field_hooks in hooks.values() for hook in field_hooks):
    return {}  # nothing to analyse: the build costs nothing more
  whole = whole()
  for reader, index in reads:
    value = whole.of(reader.inputs[index])
    if value is not reader.inputs[index]:
      _tf.update_input(reader, index, value)
  changed = {}
  for field, field_hooks in hooks.items():
    for position, hook in enumerate(field_hooks):
      if isinstance(hook, tf.compat.v1.train.LoggingTensorHook):
        logged = _whole_tensors(hook, whole, layout.graph)
        if logged is not None:
          field_hooks[position] = logged
          changed[field] = field_hooks
  return changed


def _whole_tensors(hook, whole, graph):
  """A copy of the `LoggingTensorHook` that logs the whole batch's values,
  or None if it logs none over the batch. A copy: the user's hook may be
  handed to the next graph's `model_fn` too, by names of its tensors."""
  tensors = _tf.logging_hook_tensors(hook)
  changed = False
  for tag, given in tensors.items():
    tensor = _graph_tensor(graph, given)
    value = tensor if tensor is None else whole.of(tensor)
    if value is not tensor:
      tensors[tag] = value
      changed = True
  if not changed:
    return None
  logged = copy.copy(hook)
  _tf.set_logging_hook_tensors(logged, tensors)
  return logged


def _summary_reads(ops):
  """(op, input index) of each value tower 0's summaries show: the summary
  op's own input, or where a `record_if` cond captured it."""
  reads = []
  for op in ops:
    if op.type in SUMMARY_INPUTS and len(op.inputs) > SUMMARY_INPUTS[op.type]:
      reader, index = op, SUMMARY_INPUTS[op.type]
      # TF 1 control flow: the value enters the cond through a Switch.
      while (reader.inputs[index].op.type in _CAPTURES and
             _tf.built_in_control_flow(reader.inputs[index].op)):
        reader, index = reader.inputs[index].op, 0
      reads.append((reader, index))
    elif op.type in _CONDS and set(SUMMARY_INPUTS) & (
        _tf.called_functions(op) or set()):
      reads.extend((op, index) for index in range(1, len(op.inputs)))
  return reads


def _graph_tensor(graph, given) -> Optional[tf.Tensor]:
  """A hook's tensor, given as a tensor or by name (`"loss"`, `"loss:0"`)."""
  if isinstance(given, tf.Tensor):
    return given
  if not isinstance(given, str):
    return None
  try:
    found = graph.as_graph_element(given if ":" in given else given + ":0")
  except (KeyError, ValueError):
    return None
  return found if isinstance(found, tf.Tensor) else None
