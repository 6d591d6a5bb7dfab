"""A `model_fn` returning `tf.compat.v1.estimator.tpu.TPUEstimatorSpec`.

google-research/bert and its descendants (ALBERT, ELECTRA, XLNet) return
one, run with `use_tpu=False`. Unwrapped, `TPUEstimator` turns it into an
`EstimatorSpec` with `as_estimator_spec()`: it calls `scaffold_fn` once,
and `eval_metrics=(metric_fn, tensors)` once on the batch's tensors (a
list: positional arguments; a dict: keyword arguments).

On towers: tower 0's spec is converted by that same `as_estimator_spec()`,
in tower 0's scope, right after its `model_fn` returned, so `scaffold_fn`
runs once and `metric_fn` makes its metric variables under the unwrapped
names, on tower 0's device. The tensors tower 0 hands to `metric_fn` (and
to a `host_call`) are stand-ins (see `replicate.gradients.stand_ins`) that
`connect_batch` makes, once every tower is built, pass on every tower's
tensors concatenated along dimension 0 in tower order: the whole batch's,
in input order, as a TPU's host concatenates its cores'. So a metric over
the batch (a corpus BLEU through `py_func`, a median) is one device's.
Towers 1..N-1's specs are converted with tower 0's metrics and no scaffold,
hooks or host call of their own: their `metric_fn` and `scaffold_fn` are
never called.

On what is concatenated: a tensor computed from the tower's rows
(`replicate.shard.rows`'s rule) must have one row per input row; one that
is not (a constant) is tower 0's, as unwrapped. What a tower computed on a
stand-in row is left out.

An `EstimatorSpec` comes back either way: `Estimator` needs one, and
`TPUEstimator(use_tpu=False)` accepts one as it is.
"""

from typing import Any, List

import tensorflow as tf

from replicate.gradients import stand_ins
from replicate.shard import rows as rows_lib

_HOST_CALLS = ("eval_metrics", "host_call")


def _tpu_spec_class():
  # Looked up only when a model_fn returns something else than an
  # EstimatorSpec: the lookup logs a deprecation warning.
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec


def is_tpu_spec(spec: Any) -> bool:
  return (spec is not None and
          not isinstance(spec, tf.estimator.EstimatorSpec) and
          isinstance(spec, _tpu_spec_class()))


def as_estimator_spec(spec: Any) -> Any:
  """`spec`, an `EstimatorSpec` (a `TPUEstimatorSpec` converted as
  `TPUEstimator` converts it on CPU); one tower, or a SavedModel's graph."""
  if not is_tpu_spec(spec):
    return spec
  # `TPUEstimatorSpec` keeps its host calls on the class, set by the last
  # one made: make this one again, then convert it at once.
  return _remade(spec, {}).as_estimator_spec()


class BatchCalls:
  """Tower 0's stand-ins for the batch's host-call tensors, to connect."""

  def __init__(self):
    self._standing_in: List[tuple] = []  # (stand-in, call name, path)
    self._tower_tensors = {}  # (call name, path) -> [tensor per tower]
    self._tower0_metrics = None

  def tower_spec(self, spec: Any, index: int, rows) -> Any:
    """Tower `index`'s `EstimatorSpec` from its `TPUEstimatorSpec`.

    Built in tower `index`'s scope, right after its `model_fn` returned.
    `rows` is `replicate.shard.rows`'s rule for the tower, for tower 0.
    """
    if not is_tpu_spec(spec):
      if index and self._tower0_metrics is not None:
        raise ValueError(_UNLIKE.format(index, "an EstimatorSpec",
                                        "a TPUEstimatorSpec"))
      return spec
    if index and self._tower0_metrics is None:
      raise ValueError(_UNLIKE.format(index, "a TPUEstimatorSpec",
                                      "an EstimatorSpec"))
    for name in _HOST_CALLS:
      call = getattr(spec, name)
      if call is None:
        continue
      _, tensors = call
      for path, tensor in _flat(tensors):
        self._tower_tensors.setdefault((name, path), []).append(
            tf.convert_to_tensor(tensor))
    if index:
      converted = tf.estimator.EstimatorSpec(
          mode=spec.mode, predictions=spec.predictions, loss=spec.loss,
          train_op=spec.train_op, export_outputs=spec.export_outputs,
          eval_metric_ops=self._tower0_metrics or None)
      return converted
    replaced = {}
    for name in _HOST_CALLS:
      call = getattr(spec, name)
      if call is None:
        continue
      function, tensors = call
      replaced[name] = (function, self._stand_ins(name, tensors, rows))
    converted = _remade(spec, replaced).as_estimator_spec()
    self._tower0_metrics = dict(converted.eval_metric_ops or {})
    return converted

  def _stand_ins(self, name, tensors, rows):
    def stand_in_for(path, tensor):
      tensor = tf.convert_to_tensor(tensor)
      if not rows.depend([tensor]):
        return tensor  # tower 0's, as unwrapped
      if tensor.shape.rank == 0 or not _is_batch_major(tensor, rows):
        raise ValueError(
            "TPUEstimatorSpec.{}'s tensor {} ({!r}) is computed from the "
            "rows but is {}: its tensors must be batch-major (one "
            "row per input row), as on a TPU, so that the towers' can be "
            "concatenated into the whole batch's. Pass the per-row values "
            "and reduce them in the function.".format(
                name, path, tensor, "a scalar" if tensor.shape.rank == 0
                else "not one row per input row (e.g. tf.reshape(loss, "
                "[1]))"))
      shape = tensor.shape
      if shape.rank:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
      opened = tf.compat.v1.placeholder_with_default(tensor, shape)
      standing_in = stand_ins.stand_in(opened, name="whole_batch")
      self._standing_in.append((standing_in, name, path))
      return standing_in

    if isinstance(tensors, dict):
      return {key: stand_in_for(repr(key), value)
              for key, value in tensors.items()}
    return [stand_in_for(str(i), value) for i, value in enumerate(tensors)]

  def whole_batch_ops(self) -> List[tf.Operation]:
    """The stand-ins' ops: their values are the whole batch's (after
    `connect_batch`), not tower 0's rows."""
    return [standing_in.op for standing_in, _, _ in self._standing_in]

  def connect_batch(self, layout) -> None:
    """Once every tower is built: the stand-ins pass on the whole batch's
    tensors."""
    shards = layout.shards
    for standing_in, name, path in self._standing_in:
      tensors = self._tower_tensors[(name, path)]
      if len(tensors) != layout.num_towers:
        raise ValueError(
            "TPUEstimatorSpec.{}: some towers' specs have tensor {} and "
            "others not. Each tower's model_fn must return the same "
            "structure, whatever its data.".format(name, path))
      with tf.name_scope("whole_batch_{}".format(name)):
        if shards.may_stand_in:
          tensors = [t[:shards.sizes[i]] for i, t in enumerate(tensors)]
        stand_ins.connect(standing_in, tf.concat(tensors, axis=0))


def _flat(tensors):
  if isinstance(tensors, dict):
    return [(repr(key), value) for key, value in tensors.items()]
  return [(str(i), value) for i, value in enumerate(tensors)]


def _remade(spec, replaced):
  """A new `TPUEstimatorSpec` like `spec`, with `replaced` fields."""
  fields = spec._asdict()
  fields.update(replaced)
  return _tpu_spec_class()(**fields)


_UNLIKE = ("Tower {} returned {} where tower 0 returned {}. Each tower's "
           "model_fn must return the same kind of spec, whatever its data.")


def _is_batch_major(tensor, rows) -> bool:
  """Whether `tensor`'s dimension 0 can be the tower's rows, as far as the
  static shapes tell: a size the rows do not have is not (a `[1]` tensor
  of a loss, where the batch's size is known only at run time)."""
  size = tf.compat.dimension_value(tensor.shape[0])
  if size is None:
    return True
  count = rows.static_count()
  return size == count if count is not None else size != 1
