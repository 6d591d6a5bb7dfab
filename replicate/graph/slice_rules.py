"""The rule of slices along the rows' axis: `x[0]`, `x[1:]`, `x[:2]`,
`x[::2]` pick rows by their position in the shard.

On why: on one device `x[0]` is the batch's first row; on N towers each
tower's slice picks its own shard's first row, and `x[1:]` drops each
shard's first, `x[:2]` keeps each shard's first two (a loss of `h * h[0]`
trained 0.15 off on 2 towers, silently, on f65e512). A slice keeps rows
apart only where it keeps the whole rows' axis: from its start (a begin of
0, or masked) to its end (an end masked, or the rows' count
`tf.shape(x)[0]`), step 1. Any other bound on that axis combines rows:
refused on the loss's path (`replicate.shard.rows_meet`), computed on the
whole batch's rows off it; a start known only when run (`x[i]`, a loop
over the batch's rows, one row a step) too, inside a TF 2 loop's body as
well (`replicate.graph.row_rules`). Slices of other axes (`x[:, 0]`, `x[..., :k]`)
and of shape vectors (`tf.shape(x)[1:]`) are not looked at.
"""

from replicate.graph import slice_layout
from replicate.graph.row_facts import ROWS, ROWS_K, dims_of


def strided_slice(finder, op):
  """Why a `StridedSlice` of rows combines them, or None."""
  fact = finder.layout.fact(op.inputs[0])
  rank = op.inputs[0].shape.rank
  if not fact.carries or rank is None:
    return None
  masks = {name: op.get_attr(name + "_mask") for name in (
      "begin", "end", "ellipsis", "new_axis", "shrink_axis")}
  count = op.inputs[1].shape.num_elements()
  if count is None:
    return None
  mapping = slice_layout.slice_axes(rank, count, masks)
  if mapping is None:
    return None
  # Each entry, None where known only when run (`x[0:n, i]`).
  begin = slice_layout.entries(op.inputs[1], count)
  strides = slice_layout.entries(op.inputs[3], count)
  spec = [s for axis, _, s in mapping if axis == fact.axis]
  if not spec or spec[0] is None:
    return None  # the rows' axis is under an ellipsis: whole
  spec = spec[0]
  if masks["shrink_axis"] >> spec & 1:
    return _PICKS.format("one row", "x[0]")
  if strides[spec] != 1:
    return _PICKS.format("rows by a step", "x[::2]")
  if not masks["begin"] >> spec & 1 and begin[spec] != 0:
    return _PICKS.format("rows from a start other than the first",
                         "x[1:]")
  if not masks["end"] >> spec & 1 and not _counts_rows(
      finder, op.inputs[2], spec):
    return _PICKS.format("rows up to an end that is not the rows' count",
                         "x[:2]")
  return None


def slice_(finder, op):
  """Why a `Slice` (`tf.slice`) of rows combines them, or None."""
  fact = finder.layout.fact(op.inputs[0])
  if not fact.carries:
    return None
  count = op.inputs[1].shape.num_elements()
  if count is None or fact.axis >= count:
    return None
  begin = slice_layout.entries(op.inputs[1], count)
  if begin[fact.axis] != 0:
    return _PICKS.format("rows from a start other than the first",
                         "tf.slice(x, [1, 0], [-1, -1])")
  size = slice_layout.entries(op.inputs[2], count)
  if size[fact.axis] == -1:
    return None
  if _counts_rows(finder, op.inputs[2], fact.axis):
    return None
  return _PICKS.format("a number of rows that is not the rows' count",
                       "tf.slice(x, [0, 0], [2, -1])")


def _counts_rows(finder, bounds, entry) -> bool:
  """Whether entry `entry` of a slice's bounds is the rows' count."""
  dims = dims_of(finder.layout.fact(bounds), bounds)
  if dims is None or entry >= len(dims):
    return False
  return dims[entry] in (ROWS, ROWS_K)


_PICKS = ("it slices the rows' axis: it picks {} by position in the "
          "tower's shard ({}), where one device picks them by position in "
          "the whole batch")

RULES = {"StridedSlice": strided_slice, "Slice": slice_}
