"""One run of a check: the unwrapped `model_fn` on one device, or wrapped
on N towers with one variable strategy, built and run as the Estimator
would (its scaffold, its hooks, a session restored from a checkpoint), on
the replayed batches.

On the initial state: one checkpoint, made by initializing the unwrapped
`model_fn`'s TRAIN graph once (every variable, optimizer slot and the
global step), which every run restores, so that each starts from the same
values whatever its graph's seeds. Evaluation and prediction restore one
device's checkpoint after training (or that initial state), so that what
they compare does not carry a training difference.
"""

import dataclasses
import os
import traceback
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

from replicate import _tf
from replicate import model_fn as model_fn_lib
from replicate.check import batches as batches_lib
from replicate.check import randoms

ModeKeys = tf.estimator.ModeKeys
MODES = {"train": ModeKeys.TRAIN, "eval": ModeKeys.EVAL,
         "predict": ModeKeys.PREDICT}


@dataclasses.dataclass
class Setup:
  """What every run of a check shares."""
  model_fn: Any
  params: Optional[dict]
  config: Any  # the RunConfig the model_fn is given
  session_config: Any
  workdir: str


@dataclasses.dataclass
class Built:
  graph: tf.Graph
  spec: Any
  towers: int
  inputs: Any = None  # (features, labels) the pipeline gives the model_fn


class Refused(Exception):
  """Building the wrapped `model_fn` raised: `error`, in `graph`;
  `by_replicate`: raised by replicate (a refusal, with its fix), not by
  TensorFlow or the user's code."""

  def __init__(self, error, graph):
    super().__init__(str(error))
    self.error = error
    self.graph = graph
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = traceback.extract_tb(error.__traceback__)
    self.by_replicate = bool(frames) and frames[-1].filename.startswith(
        package + os.sep)


def build(setup: Setup, mode: str, batches, towers: int = 1,
          strategy: Optional[str] = None) -> Built:
  """The graph of one run: the model_fn on the batches' pipeline."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
    tf.compat.v1.train.get_or_create_global_step()
    features, labels = batches_lib.next_batch(
        batches, with_labels=mode != "predict")
    try:
      if strategy is None:
        spec = _call(setup, features, labels, MODES[mode])
      else:
        wrapped = model_fn_lib.replicate_model_fn(
            setup.model_fn, variable_strategy=strategy,
            devices=["/cpu:{}".format(i) for i in range(towers)])
        spec = wrapped(features=features, labels=labels, mode=MODES[mode],
                       params=setup.params if "params" in _tf.fn_args(
                           setup.model_fn) else None, config=setup.config)
    except ValueError as error:
      if strategy is None:
        raise
      raise Refused(error, graph) from error
    if hasattr(spec, "as_estimator_spec"):  # a TPUEstimatorSpec
      spec = spec.as_estimator_spec()
  return Built(graph, spec, towers, (features, labels))


def _call(setup, features, labels, mode):
  """The unwrapped model_fn, called by keyword as the Estimator calls it."""
  names = _tf.fn_args(setup.model_fn)
  kwargs = {"features": features}
  for name, value in (("labels", labels), ("mode", mode),
                      ("params", setup.params), ("config", setup.config)):
    if name in names:
      kwargs[name] = value
  return setup.model_fn(**kwargs)


def supports(built: Built, mode: str) -> bool:
  """Whether the spec has what the Estimator needs in `mode`."""
  spec = built.spec
  if mode == "train":
    return spec.train_op is not None and spec.loss is not None
  if mode == "eval":
    return spec.loss is not None
  return spec.predictions is not None


class _KeepSession(tf.compat.v1.train.SessionRunHook):
  """Keeps the raw session, to save a checkpoint with the scaffold's Saver."""

  session = None

  def after_create_session(self, session, coord):
    del coord
    self.session = session


def tower_shapes(session, built: Built, draws, batch):
  """The shapes of the towers' copies of the recorded random ops on
  `batch` (`randoms.feeds` splits one device's draw by them), from one
  run of their shape inputs, the pipeline's outputs fed `batch` (no batch
  is read from it)."""
  wanted = randoms.shapes_to_fetch(built.graph, draws, built.towers)
  if not wanted:
    return {}
  feed = {}
  for tensors, values in zip(built.inputs, (batch.features, batch.labels)):
    if tensors is None:
      continue
    # A SparseTensor's parts in the order of a SparseTensorValue's fields.
    tensors = tf.nest.flatten(tensors, expand_composites=True)
    values = tf.nest.flatten(values)
    if len(tensors) != len(values):
      return {}
    feed.update(zip(tensors, values))
  try:
    return session.run(wanted, feed_dict=feed)
  except (tf.errors.OpError, TypeError, ValueError):
    return {}  # then fed as before: by rows along the first axis


def _session(setup, built, checkpoint, hooks):
  creator = tf.compat.v1.train.ChiefSessionCreator(
      scaffold=built.spec.scaffold, checkpoint_filename_with_path=checkpoint,
      config=setup.session_config)
  return tf.compat.v1.train.MonitoredSession(session_creator=creator,
                                             hooks=hooks)


def _save(built, keep, path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return built.spec.scaffold.saver.save(keep.session, path,
                                        write_meta_graph=False)


def initial_state(setup: Setup, built: Built) -> str:
  """A checkpoint of `built`'s variables, initialized once."""
  keep = _KeepSession()
  with built.graph.as_default():
    with _session(setup, built, None, [keep]):
      return _save(built, keep,
                   os.path.join(setup.workdir, "initial", "model.ckpt"))


@dataclasses.dataclass
class Result:
  """One run's values, {name: value}, and one device's draws per step."""
  values: Dict[str, Any]
  draws: List[Dict[str, List[np.ndarray]]]
  checkpoint: Optional[str] = None


def run(setup: Setup, built: Built, mode: str, batches, checkpoint: str,
        name: str, draws=None) -> Result:
  """Runs `built` over `batches` from `checkpoint`: trains, evaluates or
  predicts. One device (`draws` None) records its random draws; a wrapped
  run is fed them."""
  spec, graph = built.spec, built.graph
  keep = _KeepSession()
  values, recorded = {}, []
  with graph.as_default():
    record = randoms.fetches(randoms.find(graph, _targets(spec, mode))
                             if draws is None else [])
    summaries = _scalar_summaries(graph) if mode == "train" else {}
    metrics = dict(spec.eval_metric_ops or {}) if mode == "eval" else {}
    hooks = list({"train": spec.training_hooks,
                  "eval": spec.evaluation_hooks,
                  "predict": spec.prediction_hooks}[mode] or ())
    if mode == "train":
      hooks += list(spec.training_chief_hooks or ())
    predictions = []
    with _session(setup, built, checkpoint, hooks + [keep]) as session:
      for step, batch in enumerate(batches):
        fetch = {"draws": record}
        if mode == "train":
          fetch.update(train=spec.train_op, loss=spec.loss,
                       summaries=summaries)
        elif mode == "eval":
          fetch.update(loss=spec.loss,
                       update=[m[1] for m in metrics.values()])
        else:
          fetch.update(predictions=spec.predictions)
        feed = ({} if draws is None else randoms.feeds(
            graph, draws[step], batch.rows, built.towers,
            tower_shapes(keep.session, built, draws[step], batch)))
        got = session.run(fetch, feed_dict=feed)
        recorded.append(got["draws"])
        if mode != "predict":
          values["{}loss step {}".format(
              "eval " if mode == "eval" else "", step + 1)] = got["loss"]
        for tag, value in got.get("summaries", {}).items():
          values["summary {} step {}".format(tag, step + 1)] = value
        if mode == "predict":
          predictions.append(got["predictions"])
      if mode == "eval":
        for key, value in session.run(
            {k: m[0] for k, m in metrics.items()}).items():
          values["metric " + key] = value
      saved = None
      if mode == "train":
        saved = _save(built, keep, os.path.join(setup.workdir, name,
                                                "model.ckpt"))
  if mode == "train":
    reader = tf.train.load_checkpoint(saved)
    for variable, _ in tf.train.list_variables(saved):
      values["variable " + variable] = reader.get_tensor(variable)
  if predictions:
    for key, value in _concatenated(predictions).items():
      values["prediction " + key] = value
  return Result(values, recorded, saved)


def _targets(spec, mode):
  """What a mode runs: the tensors whose random ops one device records."""
  if mode == "train":
    return [spec.train_op, spec.loss]
  if mode == "eval":
    return [spec.loss] + [m[1] for m in (spec.eval_metric_ops or {}).values()]
  return tf.nest.flatten(spec.predictions)


def _scalar_summaries(graph) -> Dict[str, tf.Tensor]:
  """The value of each v1 scalar summary, by its tag (its op's name when
  the tag is not a constant): op names may be uniquified differently in a
  wrapped graph, tags are what TensorBoard shows."""
  found = {}
  for summary in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES):
    if isinstance(summary, tf.Tensor) and summary.op.type == "ScalarSummary":
      tag = tf.get_static_value(summary.op.inputs[0])
      tag = tag.decode() if isinstance(tag, bytes) else (
          summary.op.name if tag is None else str(tag))
      found[tag] = summary.op.inputs[1]
  return found


def _concatenated(batches: List[Any]) -> Dict[str, np.ndarray]:
  """Each key's batches one after another; a width that differs from batch
  to batch (a tagger's longest sentence, a beam search's length) padded to
  the widest batch's, as the wrapper pads the towers' (one device's and
  the towers' runs are padded alike, so they still compare)."""
  if not isinstance(batches[0], dict):
    batches = [{"predictions": value} for value in batches]
  return {key: np.concatenate(_padded([np.asarray(b[key]) for b in batches]))
          for key in batches[0]}


def _padded(values: List[np.ndarray]) -> List[np.ndarray]:
  widest = np.max([v.shape[1:] for v in values], axis=0) if (
      values[0].ndim > 1) else ()
  fill = b"" if values[0].dtype.kind == "S" else (
      "" if values[0].dtype.kind in "UO" else 0)
  return [np.pad(v, [(0, 0)] + [(0, int(w) - size) for w, size in zip(
      widest, v.shape[1:])], constant_values=fill) if v.ndim > 1 else v
          for v in values]
