"""Apart from the build: a `TF_CONFIG` cluster with parameter servers.

- `ps_cluster`: this worker's towers, where it sums, its hooks and Saver.
- `session_hooks`: around the cluster's sessions (shutdown, restarts).
- `processes`: the launcher's tasks as processes (`replicate.launch`).
"""
