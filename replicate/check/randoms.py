"""Random ops, compared fairly: each tower is fed one device's draw.

On why: a tower draws its own numbers (its dropout mask, its samples), so
a model with dropout would never equal one device. Graph mode lets a
session feed any tensor: one device's run records what each random op on
the path to the spec's outputs drew at each step, and tower i's copy of
the op (`tower_i/<name>`, tower 0 under the op's own name) is fed the
rows of that draw for its shard (its first dimension is the batch's, or
k entries per row, as a dropout over a `[rows * k, ...]` reshape draws), or
the whole draw (a value for the batch, e.g. a sampler's classes).
"""

from typing import Dict, List

import numpy as np
import tensorflow as tf

from replicate import graph_walk
from replicate.check import batches as batches_lib
from replicate.graph import op_types

# Op types that draw at random but are not "Random..." by name.
_OTHER_RANDOM_TYPES = frozenset([
    "Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal",
    "StatelessMultinomial", "StatelessTruncatedNormal",
    "StatelessTruncatedNormalV2",
])
# Random, but they reorder the rows: the rows rule refuses them.
_NOT_FED = frozenset(["RandomShuffle", "RandomShuffleQueueV2"])


def is_random(op: tf.Operation) -> bool:
  if op.type in _NOT_FED:
    return False
  return ("Random" in op.type or "Sampler" in op.type or
          op.type in _OTHER_RANDOM_TYPES)


def find(graph: tf.Graph, targets) -> List[tf.Operation]:
  """The random ops `targets` are computed from, in graph order, whose
  outputs can be fed."""
  behind = set(graph_walk.ops_behind(
      [t for t in targets if isinstance(t, (tf.Tensor, tf.Operation))],
      follow_control=True))
  return [op for op in graph.get_operations()
          if op in behind and is_random(op) and op.outputs and
          all(graph.is_feedable(t) for t in op.outputs)]


def fetches(ops: List[tf.Operation]) -> Dict[str, List[tf.Tensor]]:
  """What to fetch to record one device's draws: {op name: its outputs}."""
  return {op.name: list(op.outputs) for op in ops}


def _copies(graph, name, towers):
  """(tower, its copy of the op `name`) for each tower that has one."""
  for tower in range(towers):
    try:
      yield tower, graph.get_operation_by_name(
          name if tower == 0 else "tower_{}/{}".format(tower, name))
    except KeyError:
      continue


def shapes_to_fetch(graph: tf.Graph, draws, towers: int):
  """{output name: its shape input} of the towers' copies of the recorded
  ops that draw to a shape they are given (dropout's mask)."""
  if towers < 2:
    return {}
  return {op.outputs[0].name: op.inputs[0] for name in draws
          for _, op in _copies(graph, name, towers)
          if op.type in op_types.RANDOM_OF_SHAPE_TYPES}


def feeds(graph: tf.Graph, draws: Dict[str, List[np.ndarray]], rows: int,
          towers: int, shapes=None) -> Dict[str, np.ndarray]:
  """Tower i's copy of each recorded op, fed the draw's rows for tower i
  (or the whole draw, when its first dimension is not the batch's rows);
  by tensor name, as a session's feed_dict takes them. `shapes`: the
  towers' draws' shapes when run (`shapes_to_fetch`'s): where they part
  one device's along one axis, each tower is fed its part there (the
  tokens a padding removal keeps, `[1, tokens, d]`: tower i's are the
  ones after towers 0..i-1's)."""
  sizes = batches_lib.shard_rows(rows, towers)
  starts = np.cumsum([0] + sizes[:-1])
  found = {}
  for name, values in draws.items():
    copies = list(_copies(graph, name, towers))
    parts = _parts(copies, values, shapes or {})
    for tower, op in copies:
      for index, (tensor, value) in enumerate(zip(op.outputs, values)):
        value = np.asarray(value)
        block = _rows_block(tensor, value, rows, sizes[tower])
        if index == 0 and parts:
          value = value[parts[tower]]
        elif towers > 1 and block:
          value = value[starts[tower] * block:
                        (starts[tower] + sizes[tower]) * block]
        found[tensor.name] = value
  return found


def _parts(copies, values, shapes):
  """{tower: the index of its part of one device's first draw}, where the
  towers' shapes differ from one device's along one axis only and their
  sizes there add up to its; else None."""
  if not values or len(copies) < 2 or any(
      op.outputs[0].name not in shapes for _, op in copies):
    return None
  whole = np.shape(values[0])
  towers = {tower: tuple(np.ravel(shapes[op.outputs[0].name]))
            for tower, op in copies}
  if any(len(shape) != len(whole) for shape in towers.values()):
    return None
  axes = {axis for shape in towers.values()
          for axis, size in enumerate(shape) if size != whole[axis]}
  if len(axes) != 1:
    return None
  axis = axes.pop()
  if sum(shape[axis] for shape in towers.values()) != whole[axis]:
    return None
  parts, start = {}, 0
  for tower in sorted(towers):
    end = start + towers[tower][axis]
    parts[tower] = (slice(None),) * axis + (slice(start, end),)
    start = end
  return parts


def _rows_block(tensor, value, rows, tower_rows):
  """How many entries of the draw's first dimension each row has (1: the
  rows themselves; k: a draw over a `[rows * k, ...]` reshape of the rows,
  TF-Ranking's dropout on each list's items flattened), or 0 when it is a
  value for the batch. The tower's own shape tells when it is known: a
  draw of the batch's size is then `tower_rows * k` long there."""
  if not value.ndim or not rows or value.shape[0] % rows:
    return 0
  block = value.shape[0] // rows
  first = tensor.shape[0] if tensor.shape.rank else None
  if first is None:
    return block
  return block if first == tower_rows * block != value.shape[0] else 0
