"""What op types mean, on the ground floor: every step reads it.

- `row_ops`: the op types known to keep the batch's rows apart, by family.
- `row_rules`: the op types that combine rows in some patterns, each with
  its rule.
- `row_layout`: the row analysis: for each tensor a tower computes, which
  axis carries its rows, and for integer tensors, whether their values are
  the tower's own row positions; `row_facts` the facts it keeps of a
  tensor; `layout_ops` how each op moves them, by family: `shape_layout`
  (shapes, ranges, transposes), `reshape_layout` (reshapes to and from
  blocks of rows), `slice_layout` (slices),
  `index_layout` (gathers, scatters, segment ops), `sparse_layout` (the
  sparse ops of feature columns), `loop_layout` (TF 2 while loops, through
  their bodies, TensorLists and TF 1 TensorArrays), `frame_layout` (TF 1
  while loops: their Enter ... Exit frames in the graph itself),
  `static_layout` (what a shard of known size tells: folded constants,
  `tf.range` of the known row count).
- `index_rules`: index ops (gathers, scatters, segment ops, ...) keep rows
  apart exactly when they map each row to itself (read from `row_layout`);
  `slice_rules`: slices keep them apart where they keep the whole rows'
  axis.
- `op_types`: op types by family (variables and their writes, reductions,
  shapes, Python functions, samplers, TF 1 loops, function calls), written
  once for every module that asks what an op is.
- `declared`: the ops the user declares keep rows apart
  (`replicate.rows_apart`), which the rows rule trusts.
"""
