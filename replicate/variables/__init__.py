"""Beside the steps: where variables live and what each tower sees.

- `strategies`: one object per `variable_strategy`.
- `tasks`: what a strategy's mode means, the tasks its sums cross
  (`OneTask`, `AcrossTasks`).
- `tower_variables`: per-tower copies (`"replicated"`, tower-local).
- `matching`: which of tower 0's variables a tower's creation stands for.
- `tower_local`: `tower_local_scope` and the fold of its copies.
- `ps_slices`: a ps-held variable's slices, straight to the ps or gathered.
"""
