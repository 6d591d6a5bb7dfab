"""The CTR model of `python -m benchmarks.across_workers --model ctr`.

Written as a TF1 Estimator user writes a click-through-rate model:
`--fields` categorical features `C1`, `C2`, ... (int64 ids, one a row),
each with its own embedding table, `tf.compat.v1.get_variable(...,
partitioner=fixed_size_partitioner(shards))` and
`tf.compat.v1.nn.embedding_lookup(..., partition_strategy="div")` (the
feature columns' strategy), so that each table's gradient is `IndexedSlices`;
the embeddings concatenated, an MLP on top (`--hidden`, then 1 logit), a
logistic loss, and Adagrad (a v1 optimizer).

The ids are power-law (Zipf) per field, so hot rows repeat in a batch, as
in click logs; every task draws its own rows from its rank, the same on
every run.

Bytes a step (`step_bytes`) are counted from one traced step's
`RunMetadata.step_stats` (`trace_level=FULL_TRACE`): the runtime sizes of
the tensors that cross between tasks in that step:

- every collective op the step ran (`Collective*` in the step's stats):
  the size of its output, i.e. the reduced tensor of an all-reduce and
  every task's (padded) slices of an all-gather, what each task ends with;
- every tensor the step's session moved from one task to another by gRPC
  (the ps tasks' variable reads and embedding rows to the workers, the
  ids, gradients and updates to the ps tasks): the step's `RecvTensor`
  records whose sending and receiving devices are on different tasks, the
  bytes each received.

These are the step's tensors as TensorFlow ran them (shapes at run time,
so the ragged all-gathers count their real length), not an estimate of the
bytes on the wire: a ring all-reduce sends about 2(K-1)/K of its tensor
from each of K tasks, gRPC adds framing.
"""

import re
from typing import Dict, Iterable, List, Tuple

import numpy as np

ZIPF_EXPONENT = 1.2
_TASK = re.compile(r"^(/job:[^/]+/replica:\d+/task:\d+)")
_LABEL = re.compile(r"^\S+ = (\w+)\(")
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


def model_fn_for(fields: int, rows_a_table: int, dim: int, shards: int,
                 hidden: Iterable[int], learning_rate: float, wrap):
  """The CTR model_fn; `wrap(optimizer)` -> (optimizer, hooks)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  hidden = list(hidden)

  def model_fn(features, labels, mode):
    embedded = []
    for name in field_names(fields):
      table = tf.compat.v1.get_variable(
          "embedding_" + name, [rows_a_table, dim], tf.float32,
          initializer=tf.compat.v1.random_normal_initializer(stddev=0.05),
          partitioner=tf.compat.v1.fixed_size_partitioner(shards))
      embedded.append(tf.compat.v1.nn.embedding_lookup(
          table, features[name], partition_strategy="div"))
    net = tf.concat(embedded, axis=1)
    for index, units in enumerate(hidden):
      net = tf.compat.v1.layers.dense(net, units, tf.nn.relu,
                                      name="hidden_{}".format(index))
    logits = tf.compat.v1.layers.dense(net, 1, name="logit")
    loss = tf.compat.v1.losses.sigmoid_cross_entropy(labels, logits)
    optimizer, hooks = wrap(
        tf.compat.v1.train.AdagradOptimizer(learning_rate))
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      training_hooks=hooks)

  return model_fn


# --- bytes a step ------------------------------------------------------------


def _task(device: str) -> str:
  found = _TASK.match(device or "")
  return found.group(1) if found else ""


def _tensor_bytes(description) -> int:
  """Bytes of a step-stats tensor description (its shape x its dtype)."""
  dims = [d.size for d in description.shape.dim]
  if any(size < 0 for size in dims):
    return int(description.allocation_description.requested_bytes)
  return int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE.get(
      description.dtype, 4)


def _op_type(node, op_types: Dict[str, str]) -> str:
  """A traced node's op type: from its label (`name = Type(inputs)`, which
  also names the ops of functions, as a strategy's `cond` branches), else
  from the graph."""
  found = _LABEL.match(node.timeline_label)
  return found.group(1) if found else op_types.get(node.node_name, "")


def step_bytes(step_stats, op_types: Dict[str, str]) -> Dict[str, int]:
  """What crossed between tasks in one traced step, by kind, in bytes.

  `step_stats` is a traced run's `RunMetadata.step_stats`; `op_types` maps
  the task's graph's op names to their types (a collective keeps its name
  in the step's stats). Kinds: `collectives` (every collective's output,
  `collective ops` of them) and `send/recv` (every tensor that gRPC moved
  from one task to another in the step, as the step's `RecvTensor`
  records: `transfers` of them).
  """
  totals = {"collectives": 0, "send/recv": 0, "collective ops": 0,
            "transfers": 0}
  for device in step_stats.dev_stats:
    for node in device.node_stats:
      if not node.output:
        continue
      description = node.output[0].tensor_description
      if node.node_name == "RecvTensor":  # its bytes, no shape or dtype
        found = _TRANSFER.search(node.timeline_label)
        if found and _task(found.group(1)) != _task(found.group(2)):
          totals["send/recv"] += int(
              description.allocation_description.requested_bytes)
          totals["transfers"] += 1
      elif _op_type(node, op_types).startswith("Collective"):
        totals["collectives"] += _tensor_bytes(description)
        totals["collective ops"] += 1
  return totals
