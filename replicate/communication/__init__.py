"""Beside the steps: moving gradients between devices.

- `allreduce`: all-reduce algorithms (gather, ring, NCCL), packing, sparse
  all-gather, float16 transfer.
- `collectives`: TensorFlow's collective ops and their keys.
"""
