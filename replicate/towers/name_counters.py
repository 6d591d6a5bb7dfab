"""The graph's name counters, which make tower i pick tower 0's names.

TensorFlow keeps these counters in private places (the variable scope
store's counts, Keras's layer-name uids, the graph's names in use); this
module is the only code that touches them.
"""

from keras.src import backend as keras_backend
from tensorflow.python.ops import variable_scope as variable_scope_lib


class NameCounters:
  """Snapshots of the graph's name counters.

  Default names (`tf.compat.v1.variable_scope(None, default_name='dense')`,
  unnamed `tf.compat.v1.layers` layers, `tf.compat.v1.metrics`) are made
  unique with per-graph counters. Each tower starts from the counters tower 0
  started from, so tower i picks the same names as tower 0 and shares its
  variables; afterwards the counters are left as tower 0 left them.
  TensorFlow keeps these counters in private places; this class is the only
  code that touches them.

  (What towers see of the loss collections is `replicate.towers.tower_collections`.)
  """

  def __init__(self, graph):
    with graph.as_default():
      self._scope_store = variable_scope_lib.get_variable_scope_store()
      self._layer_uids = keras_backend.get_default_graph_uid_map()
    self._start = None
    self._end = None

  def save_start(self):
    self._start = self._snapshot()

  def save_end_of_tower0(self):
    self._end = self._snapshot()

  def restore_start(self):
    self._restore(self._start)

  def restore_end_of_tower0(self):
    if self._end is not None:
      self._restore(self._end)

  def _snapshot(self):
    return (dict(self._scope_store.variable_scopes_count),
            dict(self._layer_uids))

  def _restore(self, snapshot):
    scopes, layers = snapshot
    self._scope_store.variable_scopes_count = dict(scopes)
    self._layer_uids.clear()
    self._layer_uids.update(layers)


def release(graph, op_name: str) -> None:
  """Lets `graph.unique_name` hand out `op_name` again, though it is used.

  For a variable made ahead of the tower that will own it: the tower's own
  request for that name must get it, as it would have made it there.
  """
  graph._names_in_use.pop(op_name.lower(), None)  # pylint: disable=protected-access


def take(graph, op_name: str) -> None:
  """Marks `op_name` as used again (see `release`)."""
  graph._names_in_use[op_name.lower()] = max(  # pylint: disable=protected-access
      1, graph._names_in_use.get(op_name.lower(), 0))  # pylint: disable=protected-access
