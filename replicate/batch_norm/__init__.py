"""`sync_batch_norm=True`: batch norm with the whole batch's moments.

- `sync_batch_norm`: which calls are synchronized, the refusals, the swaps.
- `batch_norm_sites`: each tower's sites, their moments and gradients
  combined by the last tower.
- `batch_moments`: the arithmetic (Chan's combination by counts).
- `user_moments`: a user's own `tf.nn.moments` over the batch axis made a
  synchronized site while TRAIN towers are built.
"""
