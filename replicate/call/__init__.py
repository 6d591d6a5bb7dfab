"""The bottom floor: one wrapped `model_fn` call's bookkeeping, which every
build step reads. It imports no other sub-package of `replicate`.

- `current`: the context of the towers being built, found from anywhere.
- `layout`: what is fixed for the call (the towers, the batch's split, the
  strategy, the graph).
- `progress`: which tower is being built, and what each tower built.
- `devices`: device strings, local devices, a tower's device function.
- `colocation`: colocation groups the towers would split over devices,
  placed as one device places them.
- `name_counters`: TensorFlow's name counters, so tower i gets tower 0's
  names.
- `strategy`: the `VariableStrategy` Protocol, what the build asks of a
  variable strategy (`replicate.variables.strategies` makes them).
"""
