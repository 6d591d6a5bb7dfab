"""Step 1, shard: the batch split into one shard per tower.

- `sharding`: features and labels split along dimension 0 (uneven too),
  each tower's share `n_i / n`, stand-in rows for towers without rows.
- `batch_leaves`: a batch's leaves converted, named for errors, measured.
- `rows`: the one rule for "computed from the tower's rows".
- `rows_meet`: ops that combine different rows of the batch (in-batch
  negatives, top_k over the batch, ...), and op types it does not know,
  refused with `replicate.all_rows` on the loss's path; `row_finder`
  answers its rules' questions of a tensor.
- `batch_reductions`: reductions over the batch axis whose value flows
  back into rows, combined over the towers (edited after the last tower).

The op tables it reads (`row_ops`, `row_rules`), the row analysis
(`row_layout`, `index_rules`) and the user's declarations (`declared`) are
in `replicate.graph`, the ground floor.
"""
