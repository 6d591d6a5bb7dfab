"""The replication context whose towers are being built in a graph.

It is kept in a graph collection while the towers are built, so that what
the `model_fn` calls (`TowerOptimizer`, `loss_denominator`,
`tower_local_scope`, batch norm) finds it, and the collection is emptied in
`finally`. This module imports nothing of the package: any module may ask.
"""

import contextlib

import tensorflow as tf

_COLLECTION = "replicate.replication_context"


def current_context(graph=None):
  """The context of the towers being built in `graph` (default: the default
  graph), or None."""
  graph = graph or tf.compat.v1.get_default_graph()
  found = graph.get_collection(_COLLECTION)
  return found[0] if found else None


def check_none(graph) -> None:
  """Refuses a second wrapped `model_fn` built inside another's towers."""
  if graph.get_collection(_COLLECTION):
    raise ValueError(
        "replicate_model_fn was called while another replicated model_fn was "
        "being built in the same graph; wrap the model_fn once (nested "
        "replicate_model_fn calls are not supported).")


@contextlib.contextmanager
def made_current(graph, context):
  """`context` is `graph`'s current context inside, and nothing after."""
  check_none(graph)
  graph.add_to_collection(_COLLECTION, context)
  try:
    yield context
  finally:
    graph.clear_collection(_COLLECTION)
