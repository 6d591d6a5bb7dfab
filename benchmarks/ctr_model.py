"""The CTR model of `python -m benchmarks.across_workers --model ctr`.

Written as a TF1 Estimator user writes a click-through-rate model:
`--fields` categorical features `C1`, `C2`, ... (int64 ids, one a row),
each with its own embedding table, `tf.compat.v1.get_variable(...,
partitioner=fixed_size_partitioner(shards))` and
`tf.compat.v1.nn.embedding_lookup(..., partition_strategy="div")` (the
feature columns' strategy), so that each table's gradient is `IndexedSlices`;
the embeddings concatenated, an MLP on top (`--hidden`, then 1 logit), a
logistic loss, and Adagrad (a v1 optimizer). Its model_fn is
`benchmarks.job_models.ctr_model_fn_for` (beside the MLP's, the same
shape); this module holds its data and counts its bytes, without
TensorFlow.

The ids are power-law (Zipf) per field, so hot rows repeat in a batch, as
in click logs; every task draws its own rows from its rank, the same on
every run.

Bytes a step (`step_bytes`) are counted from one traced step's
`RunMetadata` (`trace_level=FULL_TRACE`, `output_partition_graphs=True`):
the runtime sizes of the tensors that cross between the chief and the other
tasks in that step, from the chief's own devices' stats:

- every collective op the step ran (`Collective*` in the step's stats):
  the size of its output, i.e. the reduced tensor of an all-reduce and
  every task's (padded) slices of an all-gather, what each task ends with;
- every tensor the chief received from another task by gRPC (variable
  reads and embedding rows from the ps tasks): its `RecvTensor` records;
- every tensor it sent to another task (ids, gradients, updates to the ps
  tasks): each `_Send` of the step's partition graphs from a chief device
  to another task's, the size of the tensor it sends (its producer's
  output in the step's stats).

These are the step's tensors as TensorFlow ran them (shapes at run time,
so the ragged all-gathers count their real length), not an estimate of the
bytes on the wire: a ring all-reduce sends about 2(K-1)/K of its tensor
from each of K tasks, gRPC adds framing.
"""

import re
from typing import Dict, List, Tuple

import numpy as np

ZIPF_EXPONENT = 1.2
_TASK = re.compile(r"^(/job:[^/]+/replica:\d+/task:\d+)")
_LABEL = re.compile(r"^\S+ = (\w+)\(")
_SENDS = ("_Send", "_HostSend")
_TRANSFER = re.compile(r" from (\S+) to (\S+)")

# tf.DType enum values -> bytes an element (those a CTR step moves).
_ITEMSIZE = {1: 4, 2: 8, 3: 4, 9: 8, 10: 1, 19: 2, 14: 2}


def field_names(fields: int) -> List[str]:
  return ["C{}".format(index + 1) for index in range(fields)]


def table_rows(total_rows: int, fields: int) -> int:
  """Rows of each field's table, so that all of them hold `total_rows`."""
  return -(-total_rows // fields)


def batch(rank: int, rows: int, fields: int, rows_a_table: int,
          exponent: float = ZIPF_EXPONENT) -> Tuple[Dict[str, np.ndarray],
                                                    np.ndarray]:
  """Task `rank`'s batch of `rows`: power-law ids per field and 0/1 labels.

  Each field's ids are Zipf-distributed ranks (1 the most frequent)
  scattered over the table by a fixed permutation of the field, so the hot
  rows lie in every shard.
  """
  random = np.random.RandomState(1000 + rank)
  features = {}
  for index, name in enumerate(field_names(fields)):
    ranks = (random.zipf(exponent, size=rows) - 1) % rows_a_table
    spread = np.random.RandomState(index).permutation(rows_a_table)
    features[name] = spread[ranks].astype(np.int64)
  labels = (random.rand(rows, 1) < 0.25).astype(np.float32)
  return features, labels


# --- bytes a step ------------------------------------------------------------


def _task(device: str) -> str:
  found = _TASK.match(device or "")
  return found.group(1) if found else ""


def _tensor_bytes(description) -> int:
  """Bytes of a step-stats tensor description: its shape x its dtype, or
  what was allocated for it if either is not known here."""
  dims = [d.size for d in description.shape.dim]
  if description.dtype not in _ITEMSIZE or any(size < 0 for size in dims):
    return int(description.allocation_description.requested_bytes)
  return int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE[description.dtype]


def _op_type(node, op_types: Dict[str, str]) -> str:
  """A traced node's op type: from its label (`name = Type(inputs)`, which
  also names the ops of functions, as a strategy's `cond` branches), else
  from the graph."""
  found = _LABEL.match(node.timeline_label)
  return found.group(1) if found else op_types.get(node.node_name, "")


def step_bytes(run_metadata, op_types: Dict[str, str],
               task: str) -> Dict[str, int]:
  """What crossed between `task` and the others in one traced step, bytes.

  `run_metadata`: the step's (`trace_level=FULL_TRACE`,
  `output_partition_graphs=True`); `op_types` maps the graph's op names to
  their types (a collective keeps its name in the step's stats); `task` as
  `/job:chief/replica:0/task:0`. Kinds: `collectives` (the output of every
  collective op run on the task's devices, `collective ops` of them),
  `received` (the task's `RecvTensor` records of tensors from other
  tasks), `sent` (the task's sends to other tasks in the step's partition
  graphs, each the size of the tensor it sends, as the step's stats give
  its producer's output; `unsized` of them had none), `send/recv` (both)
  and `transfers` (how many). Only the task's own devices' stats are
  used: another task's stats of a step come back partly at times.
  """
  outputs, totals = {}, dict.fromkeys(
      ("collectives", "collective ops", "received", "sent", "send/recv",
       "transfers", "unsized"), 0)
  for device in run_metadata.step_stats.dev_stats:
    if _task(device.device) != task:
      continue
    for node in device.node_stats:
      for output in node.output:
        outputs[(node.node_name, output.slot)] = output.tensor_description
      if not node.output:
        continue
      description = node.output[0].tensor_description
      if node.node_name == "RecvTensor":  # its bytes, no shape or dtype
        found = _TRANSFER.search(node.timeline_label)
        if found and _task(found.group(1)) != task == _task(found.group(2)):
          totals["received"] += int(
              description.allocation_description.requested_bytes)
          totals["transfers"] += 1
      elif _op_type(node, op_types).startswith("Collective"):
        totals["collectives"] += _tensor_bytes(description)
        totals["collective ops"] += 1
  for graph in run_metadata.partition_graphs:
    for node in graph.node:
      if node.op not in _SENDS or _task(
          node.attr["send_device"].s.decode()) != task or _task(
              node.attr["recv_device"].s.decode()) == task:
        continue
      name, _, slot = node.input[0].partition(":")
      description = outputs.get((name, int(slot or 0)))
      if description is None:
        totals["unsized"] += 1
        continue
      totals["sent"] += _tensor_bytes(description)
      totals["transfers"] += 1
  totals["send/recv"] = totals["received"] + totals["sent"]
  return totals
