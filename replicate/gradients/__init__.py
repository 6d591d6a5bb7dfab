"""Steps 3 and 4, combine gradients and apply once.

- `optimizer`: `TowerOptimizer` and `KerasTowerOptimizer`.
- `apply_once`: what both share: each tower's gradients weighted once,
  tower 0's one update built on stand-ins, the others recorded.
- `call_checks`: what each `apply_gradients` call is checked for.
- `optimizer_calls`: the towers' calls matched by position, their gradients
  combined and connected to tower 0's update.
- `stand_ins`: values that exist only once every tower is built.
- `touched`: gradients from `tf.gradients` or a tape that the `model_fn`
  changes before `apply_gradients`, made the whole batch's.
- `weighting`: each tower's weight (its share, or `loss_denominator`),
  and its loss weighted term by term (`loss_rule` reads the terms, with
  `loss_ops`; `term_weights` weighs them).
- `gradient_weights`: which gradients passed to `apply_gradients` still
  need the tower's weight (`tf.gradients`, a tape), weighted once.
- `aggregation`: sums of dense and sparse gradients; towers without rows.
"""
