"""Step 5, combine state: what each tower's step changes, made exact.

- `rule`: every stateful op of a tower's step classified (kept, once, a
  statistic, allowed) or refused with the fix.
- `op_kinds`: op types by what running them does to state.
- `train_op`: the one `train_op` of the step, acting on those classes.
- `statistics`: the towers' statistic writes (moving averages, `MEAN`
  variables) combined into tower 0's, the whole batch's.
- `write_edits`: a tower's built writes edited to change nothing (where it
  has no rows).
"""
