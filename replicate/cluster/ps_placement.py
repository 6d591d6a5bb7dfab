"""Where the partitioned variables of a cluster with ps tasks live: on the
ps tasks when they are looked up by rows, else replicated.

On the rule: a partitioned variable that tower 0 looks up by rows (a
gather, `embedding_lookup`, `embedding_lookup_sparse`, a feature column's
lookup) lives once on the ps tasks (`replicate.cluster.hybrid`), its parts
in turn. One that is only read whole (a TF 1 canned DNN's hidden layers,
which TensorFlow partitions by the number of ps tasks) is replicated and
all-reduced like any dense variable: a copy a tower, on every task. Its
checkpoint names and partitioning are unchanged either way.

On when: a variable is placed when it is made, but how it is read is known
only once tower 0 is built. So every part is made on a ps task, and the
first time the call asks where a variable lives after tower 0's forward
pass (tower 0's update, which comes after its gradients, or tower 1's
copies) the parts read whole move to tower 0's device, with every op
colocated with them (initialisers, reads made beside them).
"""

import contextlib
from typing import Dict, List, Set

import tensorflow as tf

from replicate import _tf
from replicate.cluster.hybrid import PS_JOB
from replicate.cluster.hybrid import check_updated_once
from replicate.cluster.hybrid import on_ps
from replicate.graph import op_types


# How a partitioned variable is read (`PsPlacement.settle`): by rows (a
# gather of the variable, or of a read of it, as `embedding_lookup` and the
# feature columns' lookups make), wholly (any other use of its value), or
# not at all (its initialiser, an assignment, its shape). A read inside a
# function (a TF 2 `cond`, a summary's `zero_fraction`) is placed where the
# variable was when the function was made: such a variable stays put.
_GATHERS = frozenset(["ResourceGather", "ResourceGatherNd", "Gather",
                      "GatherV2", "GatherNd"])
_VALUE_READS = frozenset(["ReadVariableOp", "Identity", "Snapshot"])
_NO_READS = frozenset(["VarIsInitializedOp", "IsVariableInitialized",
                       "VariableShape", "Shape", "ShapeN", "Size", "Rank",
                       "DestroyResourceOp"])
_WRITES = ("Assign", "ResourceScatter", "Scatter", "ResourceSparseApply",
           "SparseApply", "ResourceApply", "Apply")
ROWS, WHOLE, IN_FUNCTION = "rows", "whole", "function"
# Where the placements of the call wait for tower 0's build to be read.
_PLACEMENTS = "replicate_ps_placements"


def reads_of(tensor) -> Set[str]:
  """How `tensor` (a variable's handle or value) is read: a set of `ROWS`,
  `WHOLE` and `IN_FUNCTION`, empty if it is not read."""
  found = set()
  for op in tensor.consumers():
    if op.type in _GATHERS and op.inputs[0] is tensor:
      found.add(ROWS)
    elif op.type in _VALUE_READS:
      found |= reads_of(op.outputs[0])
    elif op.type in op_types.FUNCTION_CALL_TYPES:
      found.add(IN_FUNCTION)
    elif not (op.type in _NO_READS or op.type.startswith(_WRITES)):
      found.add(WHOLE)
  return found


class PsPlacement:
  """Places the partitioned variables that tower 0 looks up by rows on the
  ps tasks; the others stay with tower 0, replicated.

  `getter` is a `variable_scope` custom getter that marks a partitioned
  variable's creation: `device(op)` gives its parts the ps tasks in turn
  while it is made (slots, initialisers and reads made with it follow).
  How a variable is read is known once tower 0 is built: the first time
  the call asks where a variable lives after that (`settle`, through
  `settle_placements`), the partitioned variables read wholly (a canned
  DNN's hidden layers, which TensorFlow partitions by the number of ps
  tasks) move to tower 0's device, with every op colocated with them, and
  the ones looked up by rows take the ps tasks in turn again.
  """

  def __init__(self, num_ps: int):
    self._num_ps = num_ps
    self._parts = 0  # parts placed so far, in creation order
    self._partitioning = 0  # depth of partitioned creations under way
    self._partitioned = {}  # name -> its parts, in creation order
    self._settled = False
    tf.compat.v1.add_to_collection(_PLACEMENTS, self)

  def device(self, op: tf.Operation):
    del op  # a part's variable op: its place comes from the order alone
    if not self._partitioning:
      return None
    task = self._parts % self._num_ps
    self._parts += 1
    return _ps_device(task)

  def getter(self, getter, name, *args, **kwargs):
    if kwargs.get("partitioner") is None:
      return getter(name, *args, **kwargs)
    self._partitioning += 1
    try:
      made = getter(name, *args, **kwargs)
    finally:
      self._partitioning -= 1
    # A PartitionedVariable (no public class) iterates over its parts.
    parts = [made] if isinstance(made, tf.Variable) else list(made)
    if parts and on_ps(parts[0]) and not self._settled:
      self._partitioned.setdefault(name, parts)
    return made

  def settle(self, tower0_device: str) -> None:
    """Places each partitioned variable by how tower 0 reads it (once)."""
    if self._settled:
      return
    self._settled = True
    graph = tf.compat.v1.get_default_graph()
    by_rows, whole = [], []
    for name, parts in self._partitioned.items():
      reads = set().union(*[reads_of(part.op.outputs[0]) for part in parts])
      # Looked up by rows anywhere (a summary may read a table whole too):
      # on the ps tasks; else replicated.
      (by_rows if reads & {ROWS, IN_FUNCTION} else whole).append(name)
    colocated = _colocated_ops(graph)
    order = 0
    for name in by_rows:
      for part in self._partitioned[name]:
        check_updated_once(part, part.trainable)
        _place(part, _ps_device(order % self._num_ps), colocated)
        order += 1
    for name in whole:
      for part in self._partitioned[name]:
        _place(part, tower0_device, colocated)
    if self._partitioned:
      tf.compat.v1.logging.info(
          "replicate: with ps tasks, on the ps tasks (looked up by rows): "
          "%s; replicated on every tower (partitioned, but read whole): %s.",
          _described(by_rows, self._partitioned),
          _described(whole, self._partitioned))

  @contextlib.contextmanager
  def in_scope(self):
    """While tower 0 is built: the getter on the current variable scope
    (inherited by the scopes the model_fn opens)."""
    scope = tf.compat.v1.get_variable_scope()
    outer = scope.custom_getter
    if outer is None:
      getter = self.getter
    else:
      def getter(getter, name, *args, **kwargs):  # TF passes by keyword
        return self.getter(lambda *a, **k: outer(getter, *a, **k),
                           name, *args, **kwargs)
    scope.set_custom_getter(getter)
    try:
      yield
    finally:
      scope.set_custom_getter(outer)


def settle_placements(graph: tf.Graph, tower0_device: str) -> None:
  """Places the call's partitioned variables by how tower 0 reads them
  (`PsPlacement.settle`); asked before the first use of where a variable
  lives, once tower 0 is built. Then nothing is left waiting."""
  for placement in graph.get_collection(_PLACEMENTS):
    with graph.as_default():
      placement.settle(tower0_device)
  graph.clear_collection(_PLACEMENTS)  # a Saver's meta graph keeps none


def _ps_device(task: int) -> str:
  return "/job:{}/task:{}/device:CPU:0".format(PS_JOB, task)


def _colocated_ops(graph) -> Dict[bytes, List[tf.Operation]]:
  """Each colocation group's ops (an op is in its own name's, at least)."""
  groups = {}
  for op in graph.get_operations():
    for group in op.colocation_groups():
      groups.setdefault(group, []).append(op)
  return groups


def _place(variable, device: str, colocated) -> None:
  """`variable` and every op colocated with it (its initialiser, reads
  made beside it) on `device`."""
  for op in colocated.get(b"loc:@" + variable.op.name.encode(), []):
    _tf.set_device(op, device)


def _described(names, parts) -> str:
  if not names:
    return "none"
  return ", ".join("{} ({} part{})".format(
      name, len(parts[name]), "s" if len(parts[name]) > 1 else "")
                   for name in names)
