"""The combined spec's `Scaffold`: tower 0's, also initialising the towers.

On `local_init_op`: a `model_fn` that builds its own (e.g.
`tf.group(tf.compat.v1.tables_initializer(),
tf.compat.v1.local_variables_initializer())`) builds it in tower 0, before
towers 1..N-1 and the aggregated update exist, so it covers none of their
local variables (metric variables, `"replicated"` copies and their slots)
or lookup tables. The combined Scaffold's `local_init_op` runs the
`model_fn`'s and also initialises everything local made after tower 0. It
is still a `local_init_op`: it runs once the global variables are
initialised or restored (`ready_for_local_init_op` is untouched), so the
replicated copies start from the restored values. With no `local_init_op`
of its own, TensorFlow's default initialises every local variable and
table, and the Scaffold is left as it is.
"""

from typing import NamedTuple

import tensorflow as tf

GraphKeys = tf.compat.v1.GraphKeys


class LocalState(NamedTuple):
  """What local initialisation the graph held at one point."""
  local_variable_ops: frozenset
  table_initializers: frozenset


def local_state(graph) -> LocalState:
  """The local variables and table initializers `graph` holds now."""
  return LocalState(
      frozenset(v.op for v in graph.get_collection(GraphKeys.LOCAL_VARIABLES)),
      frozenset(graph.get_collection(GraphKeys.TABLE_INITIALIZERS)))


def initializing_towers(scaffold, after_tower0: LocalState, graph):
  """`scaffold`, whose local_init_op also covers what came after tower 0."""
  own = scaffold.local_init_op if scaffold is not None else None
  if own is None:
    in_collection = graph.get_collection(GraphKeys.LOCAL_INIT_OP)
    own = in_collection[0] if in_collection else None
  if own is None:
    return scaffold  # TensorFlow's default covers every tower
  new_variables = [
      v for v in graph.get_collection(GraphKeys.LOCAL_VARIABLES)
      if v.op not in after_tower0.local_variable_ops]
  new_tables = [
      op for op in graph.get_collection(GraphKeys.TABLE_INITIALIZERS)
      if op not in after_tower0.table_initializers]
  if not new_variables and not new_tables:
    return scaffold
  with tf.name_scope("local_init_over_towers"):
    local_init_op = tf.group(
        own, tf.compat.v1.variables_initializer(new_variables), *new_tables)
  return tf.compat.v1.train.Scaffold(local_init_op=local_init_op,
                                     copy_from_scaffold=scaffold)
