"""Step 2, build towers: the `model_fn` once per device.

- `context`: the owner of one wrapped call's pieces, and `tower_scope(i)`,
  what tower i is built in.
- `layout`: what is fixed for the call (the towers, the batch's split, the
  strategy, the graph).
- `progress`: which tower is being built, and what each tower built.
- `current`: the context of the towers being built, found from anywhere.
- `devices`: device strings, local devices, a tower's device function.
- `report`: the INFO line of the towers built; a WARNING for one tower
  where the machine has more devices.
- `tower_collections`: what each tower sees of the graph's collections.
- `name_counters`: TensorFlow's name counters, so tower i gets tower 0's
  names.
- `scaffolds`: a `model_fn`'s own `local_init_op` extended to every tower.
- `all_rows`: `replicate.all_rows` and `replicate.row_offset`, every
  tower's rows of a tensor, gradient summed back to each tower's rows;
  `all_rows_calls`: every tower's calls of it, joined once all are built.
"""
