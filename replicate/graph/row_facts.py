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
  # BLOCKED: what each row's block holds, one entry per axis folded into
  # it (`size_of`'s: a known size, or an axis of a tensor): `[rows, words,
  # d]` to `[-1, d]` holds `(words,)`, so `[-1, words, d]` is the rows
  # again. A set of such tuples, each known to be the same size (where
  # two blocks of the same rows meet); None where not known.
  block: Optional[frozenset] = None

  @property
  def carries(self) -> bool:
    """Has rows along a known axis."""
    return self.kind in CARRIES

  def moved(self, axis) -> "Fact":
    """The same rows along `axis` (None: no longer along any); the values
    are not taken for positions any more (callers that keep them say so);
    a block of rows stays the same block."""
    if axis is None:
      return Fact(UNKNOWN) if self.kind != NONE else Fact()
    return self._replace(axis=axis, dims=None, ones=False, ids=None,
                         component=None, pos_of=None, row_of=None)


class Size(str):
  """A shape-like entry of a size known only when run, `tf.shape(x)[i]`:
  OTHER to every reader, and which size it is (`of`: x's ref and i) to the
  reshapes that fold sizes into blocks of rows and back."""

  def __new__(cls, of):
    size = super().__new__(cls, OTHER)
    size.of = of
    return size


def size_of(tensor, axis):
  """What stands for the size of `tensor`'s `axis`: the number, when known
  at build time, or the axis itself."""
  size = tensor.shape.as_list()[axis]
  return size if size is not None else (tensor.ref(), axis)


def entry_size(entry):
  """A shape-like entry's size, as `size_of` gives it, or None."""
  if isinstance(entry, Size):
    return entry.of
  return entry if isinstance(entry, int) and not isinstance(
      entry, bool) else None


def with_blocks(fact, *others):
  """`fact`, its block known by every description of the same rows'
  block in `others` too (their sizes are equal where an op lets them
  meet: an elementwise op, a concat along another axis, a gather of each
  row's own positions)."""
  if fact.kind != BLOCKED:
    return fact
  blocks = [f.block for f in (fact,) + others
            if f.kind == BLOCKED and f.block is not None]
  return fact._replace(block=frozenset().union(*blocks) if blocks else None)


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
