"""Step 2, build towers: the `model_fn` once per device.

- `context`: the owner of one wrapped call's pieces, and `tower_scope(i)`,
  what tower i is built in.
- `report`: the INFO line of the towers built; a WARNING for one tower
  where the machine has more devices.
- `tower_collections`: what each tower sees of the graph's collections;
  `variable_views`: of the variable collections, tower 0's as it saw them.
- `scaffolds`: a `model_fn`'s own `local_init_op` extended to every tower.
- `all_rows`: `replicate.all_rows` and `replicate.row_offset`, every
  tower's rows of a tensor, gradient summed back to each tower's rows;
  `all_rows_calls`: every tower's calls of it, joined once all are built.

What every step reads of the call (its layout, progress, devices, name
counters, the current context) is in `replicate.call`, the floor below.
"""
