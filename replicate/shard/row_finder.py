"""What the rows rule's op rules ask of a tensor (`replicate.shard.
rows_meet` makes one `Finder` per call): whether it holds the tower's rows
along dimension 0, whether it comes from a candidate sampler's draws, and
whether it is computed from what rows hold or only from their positions.
"""

import tensorflow as tf

from replicate import graph_walk
from replicate.graph import op_types
from replicate.graph import row_facts
from replicate.graph import row_rules

# Ops whose outputs are positions (row indices), not values: segment ids
# made from them are keyed by row, not by what a row holds.
_POSITION_OP_TYPES = op_types.SHAPE_TYPES | {"Where", "Const"}


class Finder:
  """What the rules ask of a tensor: from the rows, from the rows' values."""

  def __init__(self, rows, within, shard, tower_rows, all_ops, layout):
    self.rows = rows
    self.layout = layout  # the row analysis (`replicate.graph.row_layout`)
    self._all_ops = all_ops  # tower 0's ops, samplers included
    self._within = within
    self.tower_rows = tower_rows
    leaves = tf.nest.flatten(shard, expand_composites=False)
    self._values = set()
    self._positions = set()
    for leaf in leaves:
      if isinstance(leaf, tf.SparseTensor):
        self._values.add(leaf.values.ref())
        self._positions.update([leaf.indices.ref(), leaf.dense_shape.ref()])
      elif isinstance(leaf, tf.Tensor):
        self._values.add(leaf.ref())

  def carries_rows(self, tensor: tf.Tensor) -> bool:
    """From the rows, with the rows along dimension 0 (not a value reduced
    over the batch to one row)."""
    is_shard = tensor.ref() in self._values or tensor.ref() in self._positions
    if not is_shard and (tensor.op not in self._within or
                         not self.rows.depend([tensor])):
      return False
    if not is_shard and self.layout.fact(tensor).kind == row_facts.NONE:
      return False  # made from the rows' count only (`tf.range(list_size)`)
    return row_rules.leads_with_rows(tensor, self.tower_rows)

  def sampled(self, tensor: tf.Tensor) -> bool:
    """Computed from a candidate sampler's draws (`sampled_softmax_loss`'s
    and `nce_loss`'s sampled classes, one set per batch, drawn at random)."""
    return any(op.type in op_types.SAMPLER_TYPES
               for op in graph_walk.ops_behind([tensor],
                                               within=self._all_ops))

  def from_row_values(self, tensor: tf.Tensor) -> bool:
    """Computed from what rows hold (not only from positions of rows)."""
    pending = [tensor]
    seen = set()
    while pending:
      current = pending.pop()
      if current.ref() in self._values:
        return True
      if current.ref() in self._positions or current.ref() in seen:
        continue
      seen.add(current.ref())
      op = current.op
      if (op not in self._within or op.type in _POSITION_OP_TYPES or
          "Ragged" in op.name or "RowPartition" in op.name):
        continue
      for arg, value in row_rules.named_inputs(op):
        if op.type.startswith("Sparse") and (
            "values" in arg or arg == "default_value"):
          continue
        pending.append(value)
    return False
