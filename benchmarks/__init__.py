"""Speed of replicate against one device and MirroredStrategy (python -m benchmarks)."""
