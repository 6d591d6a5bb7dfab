"""`TF_CONFIG` clusters and the launcher's processes: a floor below the steps
that sum across tasks (`gradients`, `variables`, whose strategies hold a
synchronous cluster's `CrossTask`, and `batch_norm`).

Synchronous clusters (chief and workers, no ps; every task's towers step
together):
- `server`: `replicate.start_server`, this task's server with the group
  leader the collectives need;
- `sync_cluster`: the tasks, and the collectives across them that the
  build's sums go through (`CrossTask`);
- `ragged`: collectives of tensors whose length changes every step
  (sparse gradients, `all_rows`'s rows), padded to a power of two;
- `rows_over_tasks`: `replicate.all_rows` across tasks;
- `sync_input`: each task's batch taken so that an ended input stops all;
- `sync_session`: the start of every session (guard, model check,
  broadcast from the chief) and the watchdog.

With ps tasks and `"replicated"` (embeddings on the ps tasks):
- `hybrid`: the step's update of the ps tasks, and the state kept per task;
- `ps_placement`: which partitioned variables go to the ps tasks;
- `ps_watch`: a dead ps task ends every training task in seconds;
- `empty_batch`: a tower built from an empty batch (feature columns'
  `SparseReshape` to a shape with -1).

Clusters with parameter servers:
- `hybrid`: trained synchronously (`"replicated"`): what the `model_fn`
  partitions on the ps tasks, everything else on every task;
- `ps_cluster`: this worker's towers, where it sums, its hooks and Saver.
- `session_hooks`: around the cluster's sessions (shutdown, restarts).

- `processes`: the launcher's tasks as processes (`replicate.launch`).
"""
