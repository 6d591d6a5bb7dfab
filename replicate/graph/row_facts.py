"""The facts the row analysis keeps of a tensor (`replicate.graph.row_layout`
says what they mean), and the small readers the op models share."""

from typing import NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

ALIGNED, BLOCKED, SELECTED, NONE, UNKNOWN = (
    "aligned", "blocked", "selected", "none", "unknown")
ROW, BPOS, STARTS, SPOS = "row", "bpos", "starts", "spos"
ROWS, ROWS_K, SELECTED_COUNT, OTHER = "rows", "rows*k", "selected", "other"
ROWS_PLUS = "rows+c"  # the rows' count moved by a number (`n - 1`)
CARRIES = (ALIGNED, BLOCKED, SELECTED)


class Fact(NamedTuple):
  kind: str = NONE
  axis: Optional[int] = None
  source: object = None  # SELECTED: the index tensor's ref labelling it
  ids: Optional[str] = None
  component: Optional[int] = None
  dims: Optional[Tuple] = None  # shape-like: what each entry counts
  ones: bool = False  # every value is 1 (`tf.ones_like`): x * ones is x
  pos_of: object = None  # SPOS: the source of the SELECTED axis indexed
  # NONE: one row's value, of the row at the list index `row_of` (the ref
  # of the index tensor): `tf.map_fn`'s element of a list of the rows.
  row_of: object = None

  @property
  def carries(self) -> bool:
    """Has rows along a known axis."""
    return self.kind in CARRIES

  def moved(self, axis) -> "Fact":
    """The same rows along `axis` (None: no longer along any); the values
    are not taken for positions any more (callers that keep them say so)."""
    if axis is None:
      return Fact(UNKNOWN) if self.kind != NONE else Fact()
    return self._replace(axis=axis, dims=None, ones=False, ids=None,
                         component=None, pos_of=None, row_of=None)


NO_ROWS = Fact()
UNKNOWN_ROWS = Fact(UNKNOWN)


def rank_of(tensor):
  return tensor.shape.rank


def static(tensor):
  """The value as a flat list, if known when the graph is built."""
  value = tf.get_static_value(tensor)
  return None if value is None else np.ravel(value).tolist()


def dims_of(fact, tensor):
  """A shape-like value's entries (known numbers, ROWS, ...), or None."""
  if fact.dims is not None:
    return fact.dims
  value = static(tensor)
  return None if value is None else tuple(int(v) for v in value)
