"""Step 2, build towers: the `model_fn` once per device.

- `context`: the state of one wrapped call (its fixed layout and what the
  towers built), and `tower_scope(i)`, what tower i is built in.
- `devices`: device strings, local devices, a tower's device function.
- `tower_collections`: what each tower sees of the graph's collections.
- `name_counters`: TensorFlow's name counters, so tower i gets tower 0's
  names.
- `scaffolds`: a `model_fn`'s own `local_init_op` extended to every tower.
"""
