"""Where a run differs: the first op, in graph order, whose value in a
tower is not one device's.

On how: both graphs (one device's, and the wrapped one) are built again in
the mode that differs, restored from the same checkpoint and run once on
the first batch, with the same random draws. Ops are matched by name
(tower 0 has the `model_fn`'s own names, tower i the `tower_i/` prefix).
A tensor whose first dimension is the batch's rows on one device and the
shard's in the tower holds rows: tower i's must be one device's rows
`[offset_i : offset_i + n_i]`; any other must be one device's whole value.
Only the ops the differing value is computed from are looked at, so a
value over the batch that the wrapper combines elsewhere (the loss's mean)
is looked at only when that value differs.
"""

import linecache
import os
import re
import traceback
from typing import Optional

import numpy as np
import tensorflow as tf

import replicate
from replicate import graph_walk
from replicate.check import batches as batches_lib
from replicate.check import compare
from replicate.check import randoms
from replicate.check import report as report_lib
from replicate.check import runs
from replicate.graph import declared
from replicate.graph import op_types

# Frames of these are not the user's: TensorFlow's, Keras's, ours.
_LIBRARY_PARTS = ("/tensorflow/", "/tensorflow_estimator/", "/keras/",
                  "/tf_keras/", "/absl/", "<frozen ")
_PACKAGE = os.path.dirname(os.path.abspath(replicate.__file__)) + os.sep
_SKIPPED_TYPES = frozenset(["Const", "NoOp", "VarHandleOp", "VariableV2",
                            "Placeholder", "PlaceholderWithDefault"])


def source_line(op: tf.Operation) -> str:
  """The user's line that created `op`: the last frame of its traceback
  outside TensorFlow, Keras and replicate."""
  frames = list(op.traceback or ())
  for frame in reversed(frames):
    filename = frame.filename
    if filename.startswith(_PACKAGE) or any(
        part in filename for part in _LIBRARY_PARTS):
      continue
    code = frame.line or linecache.getline(filename, frame.lineno)
    return "{}:{} in {}: {}".format(filename, frame.lineno, frame.name,
                                    code.strip())
  return ""


def source_of_error(error: BaseException) -> str:
  """The user's line an error was raised from (as `source_line`)."""
  for frame in reversed(traceback.extract_tb(error.__traceback__)):
    if frame.filename.startswith(_PACKAGE) or any(
        part in frame.filename for part in _LIBRARY_PARTS):
      continue
    code = frame.line or linecache.getline(frame.filename, frame.lineno)
    return "{}:{} in {}: {}".format(frame.filename, frame.lineno, frame.name,
                                    code.strip())
  return ""


def op_in_message(message: str, graph: tf.Graph) -> Optional[tf.Operation]:
  """The first op a refusal's message names (quoted), found in `graph`."""
  for name in re.findall(r"'([^'\s]+)'|\{\{node ([^}]+)\}\}", message):
    name = name[0] or name[1]
    try:
      return graph.get_operation_by_name(name)
    except (KeyError, ValueError):
      continue
  return None


def first_op(setup: runs.Setup, mode: str, batch, checkpoint: str,
             draws, towers: int, strategy: str, what: str,
             rtol: float, atol: float) -> Optional[report_lib.FirstOp]:
  """The first op whose tower value is not one device's, on `batch`."""
  one = runs.build(setup, mode, [batch])
  wrapped = runs.build(setup, mode, [batch], towers, strategy)
  with one.graph.as_default():
    ordered = _candidates(one, mode, what)
  one_values = _values(setup, one, checkpoint, draws, batch, 1,
                       {t.name: t for t in ordered})
  names = {}
  for tensor in ordered:
    for tower in range(towers):
      name = tensor.name if tower == 0 else "tower_{}/{}".format(
          tower, tensor.name)
      try:
        names[(tensor.name, tower)] = wrapped.graph.get_tensor_by_name(name)
      except (KeyError, ValueError):
        continue
  tower_values = _values(setup, wrapped, checkpoint, draws, batch, towers,
                         names)
  sizes = batches_lib.shard_rows(batch.rows, towers)
  starts = np.cumsum([0] + sizes[:-1])
  # Differences in order: (tensor, tower, holds rows, one device's, the
  # tower's). An op holding rows that differs is the clear sign; a value
  # over the batch may differ and be combined by the wrapper elsewhere
  # (the loss's sum, a batch norm's moments), so it is named first only
  # when it is what such an op is computed from, or when no op holding
  # rows differs.
  found = []
  for tensor in ordered:
    for tower in range(towers):
      if (tensor.name, tower) not in tower_values:
        continue
      expected = np.asarray(one_values[tensor.name])
      actual = np.asarray(tower_values[(tensor.name, tower)])
      span = _rows_span(expected, actual, batch.rows, sizes[tower],
                        starts[tower]) if towers > 1 else None
      if span is not None:
        expected = expected[span[0]:span[1]]
      elif expected.shape != actual.shape:
        continue  # a size of the tower's batch (its n_i), not a value
      if compare.difference(expected, actual, rtol, atol)[0] > 0:
        found.append((tensor, tower, span is not None, expected, actual))
  with_rows = [entry for entry in found if entry[2]]
  over_batch = {(entry[0].name, entry[1]): entry for entry in found
                if not entry[2]}
  if with_rows:
    tensor, tower = with_rows[0][:2]
    for source in tensor.op.inputs:
      if (source.name, tower) in over_batch:
        return _first_op(over_batch[(source.name, tower)], sizes, starts,
                         "; the op holding rows it feeds, {!r}, differs "
                         "then".format(tensor.op.name))
    return _first_op(with_rows[0], sizes, starts)
  if found:
    return _first_op(found[0], sizes, starts, _NO_ROWS_DIFFER)
  return None


def _first_op(entry, sizes, starts, more=""):
  tensor, tower, rows, expected, actual = entry
  return report_lib.FirstOp(
      tensor.op.name, tensor.op.type, source_line(tensor.op), tower,
      compare.summary(expected), compare.summary(actual),
      declared=declared.is_declared(tensor.op),
      note=("its rows for tower {} (one device's rows {}:{} of the "
            "batch)".format(tower, starts[tower], starts[tower] + sizes[tower])
            if rows else _BATCH_NOTE) + more)


def _rows_span(expected, actual, rows, tower_rows, start):
  """Where tower's rows are in one device's value: (begin, end) along
  dimension 0 when it holds k entries a row (k = 1 for [rows, ...]; k =
  length for [rows * length, ...], a reshape that folds a sequence), else
  None."""
  if not expected.ndim or not actual.ndim or rows == tower_rows:
    return None
  if expected.shape[1:] != actual.shape[1:] or expected.shape[0] % rows:
    return None
  per_row = expected.shape[0] // rows
  if actual.shape[0] != tower_rows * per_row:
    return None
  return start * per_row, (start + tower_rows) * per_row


_NO_ROWS_DIFFER = (
    "; no op holding rows differs: if the wrapper combines this value, the "
    "difference may be rounding grown by the optimizer (a variable whose "
    "gradient is about 0, such as a bias before a batch norm or an "
    "attention key's bias, moves by rounding noise alone under Adam)")
_BATCH_NOTE = (
    "a value over the batch: in the tower it is computed from the tower's "
    "rows only; the wrapper combines the towers' loss (by loss_reduction or "
    "replicate.loss_denominator) and their metrics, and where it does not, "
    "this is where the towers part from one device (fix: compute it on "
    "replicate.all_rows(x), or state the loss's denominator)")


def _candidates(built, mode, what):
  """One device's tensors the differing value is computed from, in graph
  order, that a session can fetch, and whose tower values must be one
  device's (see `_compared`)."""
  spec = built.spec
  if what.startswith("metric ") and what[len("metric "):] in (
      spec.eval_metric_ops or {}):
    targets = [spec.eval_metric_ops[what[len("metric "):]][1]]
  elif what.startswith("prediction ") and isinstance(spec.predictions, dict):
    targets = [spec.predictions[what[len("prediction "):]]]
  elif what.startswith("prediction "):
    targets = tf.nest.flatten(spec.predictions)
  else:
    targets = [spec.loss]
  # Control edges too: a metric's update op reads its totals after the
  # assignments that add the batch's values.
  behind = set(graph_walk.ops_behind(targets, follow_control=True))
  ordered = [op for op in built.graph.get_operations() if op in behind]
  found = []
  for op in _compared(built.graph, ordered):
    if (op.type in _SKIPPED_TYPES or "while/" in op.name or
        "/cond/" in "/" + op.name):
      continue
    found.extend(t for t in op.outputs if built.graph.is_fetchable(t) and
                 t.dtype not in (tf.resource, tf.variant))
  del mode
  return found


# Ops that change state (a metric's totals): what is computed after them
# in the same run is not compared.
_WRITE_PARTS = ("Assign", "Scatter", "Apply")


def _compared(graph, ordered):
  """The ops of `ordered` whose tower values must be one device's: not
  made from shapes only (a tower's batch has its own size: `tf.shape(x)[0]`
  is n_i there), not positions among the rows (integers computed from
  such sizes or from a `tf.where`: a tower's `tf.range(n_i)` counts its
  own shard's rows from 0), and not reading or computed from state a step
  changes (a metric's local totals, or after an assignment)."""
  local = {v.op.name for key in (tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                                 tf.compat.v1.GraphKeys.METRIC_VARIABLES)
           for v in graph.get_collection(key)}
  sizes, state = set(), set()
  for op in ordered:
    inputs = [t.op for t in op.inputs]
    if op.type in op_types.SHAPE_TYPES or (inputs and all(
        i in sizes or i.type == "Const" for i in inputs)):
      sizes.add(op)
    elif op.type == "Where" or (
        op.outputs and all(t.dtype.is_integer for t in op.outputs) and
        any(i in sizes for i in inputs)):
      sizes.add(op)  # positions: the tower's own
    if (any(part in op.type for part in _WRITE_PARTS) or
        any(i.name in local or i in state for i in inputs)):
      state.add(op)
  return [op for op in ordered if op not in sizes and op not in state]


def _values(setup, built, checkpoint, draws, batch, towers, fetches):
  """`fetches`' values in one run of `built` on its batch, random ops fed."""
  with built.graph.as_default():
    creator = tf.compat.v1.train.ChiefSessionCreator(
        scaffold=built.spec.scaffold,
        checkpoint_filename_with_path=checkpoint,
        config=setup.session_config)
    with tf.compat.v1.train.MonitoredSession(session_creator=creator) as s:
      feed = randoms.feeds(
          built.graph, draws, batch.rows, towers,
          runs.tower_shapes(s, built, draws, batch)) if draws else {}
      return s.run(fetches, feed_dict=feed)
