"""The graph's name counters, which make tower i pick tower 0's names.

TensorFlow keeps these counters in private places (the variable scope
store's counts, Keras's layer-name uids, the graph's names in use), read and
set through `replicate._tf`; this module says when.
"""

from replicate import _tf


class NameCounters:
  """Snapshots of the graph's name counters.

  Default names (`tf.compat.v1.variable_scope(None, default_name='dense')`,
  unnamed `tf.compat.v1.layers` layers, `tf.compat.v1.metrics`) are made
  unique with per-graph counters. Each tower starts from the counters tower 0
  started from, so tower i picks the same names as tower 0 and shares its
  variables; afterwards the counters are left as tower 0 left them.

  (What towers see of the loss collections is `replicate.towers.tower_collections`.)
  """

  def __init__(self, graph):
    self._graph = graph
    self._start = None
    self._end = None

  def save_start(self):
    self._start = _tf.name_counts(self._graph)

  def save_end_of_tower0(self):
    self._end = _tf.name_counts(self._graph)

  def restore_start(self):
    _tf.restore_name_counts(self._graph, self._start)

  def restore_end_of_tower0(self):
    if self._end is not None:
      _tf.restore_name_counts(self._graph, self._end)


def release(graph, op_name: str) -> None:
  """Lets `graph.unique_name` hand out `op_name` again, though it is used.

  For a variable made ahead of the tower that will own it: the tower's own
  request for that name must get it, as it would have made it there.
  """
  _tf.release_name(graph, op_name)


def take(graph, op_name: str) -> None:
  """Marks `op_name` as used again (see `release`)."""
  _tf.take_name(graph, op_name)
