"""How reshapes move the rows: to and from `[rows * k, ...]` blocks, by
the new shape's entry that counts the rows (`tf.shape(x)[0] * length`), a
leading -1 and the sizes after it (known, or `tf.shape(x)[i]` known only
when run: which sizes a block of rows holds, `Fact.block`), or known sizes
(a batch of known size)."""

import numpy as np

from replicate.graph.row_facts import (
    ALIGNED, BLOCKED, NONE, ROWS, ROWS_K, SELECTED, SELECTED_COUNT,
    UNKNOWN_ROWS, dims_of, entry_size, rank_of, size_of)


def _reshape(op, inputs):
  facts = _reshaped(op, inputs)
  fact = inputs[0]
  if fact.component is not None and facts[0].ids:
    # `tf.reshape(tf.where(mask), [-1])` of one column: the values themselves.
    sizes = op.inputs[0].shape.as_list() if rank_of(op.inputs[0]) else []
    if sizes and sizes[-1] == 1 and fact.component == 0 and (
        rank_of(op.outputs[0]) == len(sizes) - 1):
      return [facts[0]._replace(component=None)]
  return facts


def _static_reshape(fact, tensor, dims):
  """Known sizes (a batch of known size, `[3, 5, w]` to `[15, w]`): the
  rows lead both, the new first size a multiple of the rows'."""
  rows = tensor.shape.as_list()[0] if fact.axis == 0 else None
  first = dims[0] if dims else None
  if (fact.kind not in (ALIGNED, BLOCKED) or not isinstance(rows, int) or
      not isinstance(first, int) or rows <= 0 or first % rows):
    return UNKNOWN_ROWS
  if first == rows:
    return fact._replace(axis=0, dims=None, ones=False)
  return fact._replace(kind=BLOCKED, axis=0, dims=None, ones=False)


def _reshaped(op, inputs):
  """Rows to and from `[rows * k, ...]` blocks: the new shape's entry that
  counts the rows (`tf.shape(x)[0] * length`), or a leading -1."""
  fact, tensor = inputs[0], op.inputs[0]
  dims = dims_of(inputs[1], op.inputs[1])
  if not fact.carries or dims is None or rank_of(tensor) is None:
    return [fact if fact.kind == NONE else UNKNOWN_ROWS]
  before = tensor.shape.as_list()[:fact.axis]
  if any(size != 1 for size in before):
    return [UNKNOWN_ROWS]
  counts = [i for i, d in enumerate(dims)
            if d in (ROWS, ROWS_K, SELECTED_COUNT)]
  if len(counts) == 1 and all(d == 1 for d in dims[:counts[0]]):
    entry = dims[counts[0]]
    kind = {ROWS: ALIGNED, ROWS_K: BLOCKED, SELECTED_COUNT: SELECTED}[entry]
    if (kind == SELECTED) != (fact.kind == SELECTED):
      return [UNKNOWN_ROWS]
    return [fact._replace(kind=kind, axis=counts[0], dims=None, ones=False,
                          block=None)]
  if counts:
    return [UNKNOWN_ROWS]
  if -1 not in dims:
    return [_static_reshape(fact, tensor, dims)]
  where = dims.index(-1)
  if any(d != 1 for d in dims[:where]):
    return [UNKNOWN_ROWS]
  folded = _folded(fact, tensor, dims[where + 1:])
  if folded is not None:
    return [folded._replace(axis=where)]
  after_in = tensor.shape.as_list()[fact.axis + 1:]
  after_out = list(dims[where + 1:])
  if None in after_in or not all(isinstance(d, int) for d in after_out):
    if fact.kind == ALIGNED:
      return [fact._replace(kind=BLOCKED, axis=where, dims=None, ones=False)]
    return [UNKNOWN_ROWS]
  if np.prod(after_in) == np.prod(after_out):
    return [fact._replace(axis=where, dims=None, ones=False)]
  if fact.kind == ALIGNED and np.prod(after_in) % np.prod(after_out) == 0:
    return [fact._replace(kind=BLOCKED, axis=where, dims=None, ones=False)]
  return [UNKNOWN_ROWS]  # a new row of parts of several rows


def _folded(fact, tensor, after):
  """`-1` then `after`, of rows along `fact.axis` then sizes: where
  `after` is the last of each row's sizes (the block's, then its own
  axes'), `-1` counts the rows times the rest: the rows again where
  nothing is left (`[rows * words, d]` to `[-1, words, d]`), else blocks
  of what is left (`[rows, words, d]` to `[-1, d]`: blocks of `words`).
  None where the sizes do not show it."""
  if fact.kind == ALIGNED:
    blocks = [()]
  elif fact.kind == BLOCKED and fact.block is not None:
    blocks = sorted(fact.block, key=len)
  else:
    return None
  own = tuple(size_of(tensor, axis)
              for axis in range(fact.axis + 1, rank_of(tensor)))
  wanted = tuple(entry_size(entry) for entry in after)
  if None in wanted:
    return None
  left = set()
  for block in blocks:
    sizes = block + own
    if len(wanted) <= len(sizes) and (
        not wanted or sizes[len(sizes) - len(wanted):] == wanted):
      left.add(tuple(size for size in sizes[:len(sizes) - len(wanted)]
                     if size != 1))
  if not left:
    return None
  if () in left:
    return fact._replace(kind=ALIGNED, dims=None, ones=False, block=None)
  return fact._replace(kind=BLOCKED, dims=None, ones=False,
                       block=frozenset(left))


TRANSFER = {"Reshape": _reshape}
