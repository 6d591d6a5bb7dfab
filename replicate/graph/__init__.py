"""What op types mean, on the ground floor: every step reads it.

- `row_ops`: the op types known to keep the batch's rows apart, by family.
- `row_rules`: the op types that combine rows in some patterns, each with
  its rule.
- `row_layout`: the row analysis: for each tensor a tower computes, which
  axis carries its rows, and for integer tensors, whether their values are
  the tower's own row positions.
- `index_rules`: index ops (gathers, scatters, segment ops, ...) keep rows
  apart exactly when they map each row to itself (read from `row_layout`).
"""
