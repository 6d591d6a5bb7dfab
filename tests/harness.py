"""One training loop for the tests: a `model_fn` unwrapped on one device,
and wrapped on N towers, on the same batches from the same initial values.

`train` runs one of them; `train_both` runs both and returns both runs, for
a test to compare what it asserts on (the variables, the losses, values it
fetched).
"""

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

import replicate
from conftest import TRAIN, cpus, session_config


class Run(NamedTuple):
  """What one training run gave."""
  steps: List[Dict[str, Any]]  # per step, what `step_fetches` named
  variables: Dict[str, np.ndarray]  # every global variable after the last
  after: Any  # `after_fetches`'s values after the last step (None: none)

  def per_step(self, name: str) -> List[Any]:
    """The value fetched as `name` at each step."""
    return [step[name] for step in self.steps]


def _loss(spec):
  return {"loss": spec.loss}


def train(model_fn: Callable, batches: Sequence[Any],
          towers: Optional[int] = None, *, static: bool = False,
          known_rows: bool = False, step_fetches: Callable = _loss,
          after_fetches: Optional[Callable] = None,
          in_graph: Optional[Callable] = None, named_inputs: bool = False,
          session_towers: Optional[int] = None, like: Any = None,
          **wrap_kwargs) -> Run:
  """Trains `model_fn` on `batches`, one a step.

  Args:
    model_fn: the unwrapped `model_fn`, called in TRAIN with features
      {"x": x, ...} and labels y.
    batches: per step, (x, y) arrays, or a dict of arrays whose "y" is the
      labels and the rest the features; rows along dimension 0.
    towers: None: the `model_fn` as it is, on one device; N: wrapped by
      `replicate.replicate_model_fn` on N virtual CPUs, with `wrap_kwargs`.
    static: the graph gets batches of known size (local variables loaded
      before each step), else placeholders, as an `input_fn` gives.
    known_rows: the placeholders know the batch's rows (else unknown, as
      an `input_fn` ending in `.batch()` gives).
    step_fetches: `spec` -> {name: tensor} fetched with the `train_op` at
      each step (default: the loss).
    after_fetches: `graph` -> what to fetch once after the last step, or
      None.
    in_graph: called first in the new graph (e.g. Keras's float type).
    named_inputs: the static inputs' variables are named "input_<key>"
      (else TensorFlow's default names).
    session_towers: the session's virtual CPUs (default: 4, or the towers).
    like: a batch whose inputs' types and shapes the graph takes (default:
      the first; for no step at all, the initial values).

  Returns:
    A `Run`: per step the fetches, then every global variable's value.
  """
  named = [_named(batch) for batch in batches]
  template = _named(like) if like is not None else named[0]
  with tf.Graph().as_default() as graph:
    if in_graph is not None:
      in_graph()
    tf.compat.v1.train.get_or_create_global_step()
    if static:
      inputs = {key: tf.Variable(
          value, trainable=False,
          name="input_" + key if named_inputs else None,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
                for key, value in template.items()}
      given = {key: tf.identity(value) for key, value in inputs.items()}
    else:
      inputs = given = {key: tf.compat.v1.placeholder(
          tf.as_dtype(value.dtype),
          [len(value) if known_rows else None] + list(value.shape[1:]))
                        for key, value in template.items()}
    features = {key: value for key, value in given.items() if key != "y"}
    if towers is not None:
      model_fn = replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                              **wrap_kwargs)
    spec = model_fn(features=features, labels=given["y"], mode=TRAIN)
    fetches = step_fetches(spec)
    with tf.compat.v1.Session(config=session_config(
        session_towers or max(4, towers or 1))) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())  # copies
      session.run(tf.compat.v1.tables_initializer())
      steps = []
      for batch in named:
        if static:
          for key, value in batch.items():
            inputs[key].load(value, session)
          feed = None
        else:
          feed = {inputs[key]: value for key, value in batch.items()}
        steps.append(session.run([spec.train_op, fetches], feed)[1])
      variables = {v.op.name: session.run(v)
                   for v in tf.compat.v1.global_variables()}
      after = None
      if after_fetches is not None:
        after = after_fetches(graph)
        after = session.run(after) if after else {}
  return Run(steps, variables, after)


def _named(batch) -> Dict[str, np.ndarray]:
  """A batch as {input name: array}: (x, y) is {"x": x, "y": y}."""
  if isinstance(batch, dict):
    return batch
  x, y = batch
  return {"x": x, "y": y}


def train_both(model_fn: Callable, towers: int, batches: Sequence[tuple],
               **kwargs) -> tuple:
  """(the unwrapped run on one device, the run on `towers` towers), the
  same batches from the same initial values; `kwargs` as `train`'s (those
  of `replicate_model_fn` for the wrapped run only)."""
  return train(model_fn, batches, None, **_unwrapped(kwargs)), train(
      model_fn, batches, towers, **kwargs)


def assert_trained_alike(expected: Run, actual: Run) -> None:
  """`actual`'s loss at every step and every variable after the last equal
  `expected`'s (one device's), to float rounding."""
  np.testing.assert_allclose(actual.per_step("loss"),
                             expected.per_step("loss"), rtol=1e-5)
  for variable, value in expected.variables.items():
    np.testing.assert_allclose(actual.variables[variable], value, rtol=1e-5,
                               atol=1e-6, err_msg=variable)


_TRAIN_ARGS = ("static", "known_rows", "step_fetches", "after_fetches",
               "in_graph", "named_inputs", "session_towers", "like")


def classifier_spec(h, labels, mode=TRAIN):
  """A 3-class softmax head on `h` trained by gradient descent (0.5), its
  kernel seeded: the spec the row tests' model_fns end in."""
  logits = tf.compat.v1.layers.dense(
      h, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(
          seed=4))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(
          loss, tf.compat.v1.train.get_global_step()))


def _unwrapped(kwargs):
  return {key: value for key, value in kwargs.items() if key in _TRAIN_ARGS}


class LogLines(list):
  """The "tensorflow" logger's lines at INFO and above, while entered."""

  def __enter__(self):
    self._handler = logging.Handler()
    self._handler.emit = lambda record: self.append(record.getMessage())
    self._verbosity = tf.compat.v1.logging.get_verbosity()
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
    tf.get_logger().addHandler(self._handler)
    return self

  def __exit__(self, *unused):
    tf.get_logger().removeHandler(self._handler)
    tf.compat.v1.logging.set_verbosity(self._verbosity)
