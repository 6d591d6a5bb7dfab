"""`replicate.all_rows` and `replicate.row_offset`: rows that meet.

Two-tower retrieval with in-batch negatives, written as users write it:
`sim = tf.matmul(q, d, transpose_b=True)` and labels `tf.range(n)`, the
softmax over the batch's documents. Wrapped with `all_rows(d)` and labels
`+ row_offset()`, 2 SGD/Adam steps on 2 and 3 towers (7 rows on 3 towers
is 3 + 2 + 2; 2 rows on 3 towers leaves a tower on a stand-in row), with
the batch's size known or not, "parameter_server" and "replicated", give
every variable, the eval loss and the predictions of the unwrapped model on
one device to 1e-5. Without `all_rows` the same model is refused, naming
the MatMul; on main (2c8ec8c) it trained silently on each shard's own
negatives (`test_per_shard_negatives_are_not_one_device` measures by how
much).
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

PS, REPLICATED = "parameter_server", "replicated"
STEPS = 2
DIM = 5


def _init(seed):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _towers(features):
  q = tf.compat.v1.layers.dense(features["q"], 4, activation=tf.nn.tanh,
                                kernel_initializer=_init(1), name="query")
  d = tf.compat.v1.layers.dense(features["d"], 4, activation=tf.nn.tanh,
                                kernel_initializer=_init(2), name="doc")
  return q, d


def _optimizer(name):
  if name == "adam":
    return tf.compat.v1.train.AdamOptimizer(0.05)
  return tf.compat.v1.train.GradientDescentOptimizer(0.5)


def _spec(mode, q, sim, labels, optimizer):
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=sim))
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "q": q, "best": tf.argmax(sim, axis=1)})
  train_op = None
  if mode == TRAIN:
    train_op = replicate.TowerOptimizer(_optimizer(optimizer)).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def retrieval_model_fn(features, labels, mode, params):
  """In-batch negatives over the whole batch: `all_rows` and `row_offset`."""
  del labels
  q, d = _towers(features)
  sim = tf.matmul(q, replicate.all_rows(d), transpose_b=True)
  labels = tf.range(tf.shape(q)[0]) + replicate.row_offset()
  return _spec(mode, q, sim, labels, params["optimizer"])


def per_shard_model_fn(features, labels, mode, params):
  """The same model as users write it unwrapped: no `all_rows`."""
  del labels
  q, d = _towers(features)
  sim = tf.matmul(q, d, transpose_b=True)
  labels = tf.range(tf.shape(q)[0])
  return _spec(mode, q, sim, labels, params["optimizer"])


def _batches(rows, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.normal(0.0, 1.0, (rows, DIM)).astype(np.float32),
           rng.normal(0.0, 1.0, (rows, DIM)).astype(np.float32))
          for _ in range(STEPS)]


def _features(batch, static):
  if static:
    return {"q": tf.constant(batch[0]), "d": tf.constant(batch[1])}, None
  q = tf.compat.v1.placeholder(tf.float32, [None, DIM])
  d = tf.compat.v1.placeholder(tf.float32, [None, DIM])
  return {"q": q, "d": d}, {q: batch[0], d: batch[1]}


def _wrapped(model_fn, towers, **kwargs):
  if towers is None:
    return model_fn
  return replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                      **kwargs)


def _run(model_fn, rows, towers=None, optimizer="sgd", static=False,
         **kwargs):
  """{"variables": after STEPS steps, "eval_loss", "predictions"}.

  Each mode in its own graph, as the Estimator builds them; EVAL and
  PREDICT read the trained variables.
  """
  batches = _batches(rows)
  params = {"optimizer": optimizer}
  result = {}
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    steps = []
    for batch in batches:
      features, feed = _features(batch, static)
      steps.append((features, feed))
    # One graph holding one train op per batch when static; else one fed.
    features, feed = steps[0]
    spec = _wrapped(model_fn, towers, **kwargs)(
        features=features, labels=None, mode=TRAIN, params=params)
    with tf.compat.v1.Session(config=session_config(4)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      for batch in batches:
        if static:
          # Same batch each step, as a static batch is a constant.
          session.run(spec.train_op)
        else:
          session.run(spec.train_op, {features["q"]: batch[0],
                                      features["d"]: batch[1]})
      values = {v.op.name: session.run(v)
                for v in tf.compat.v1.global_variables()}
  result["variables"] = {name: value for name, value in values.items()
                         if not name.startswith("tower_")}
  for mode, key in ((EVAL, "eval_loss"), (PREDICT, "predictions")):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      features, feed = _features(batches[-1], static)
      spec = _wrapped(model_fn, towers, **kwargs)(
          features=features, labels=None, mode=mode, params=params)
      with tf.compat.v1.Session(config=session_config(4)) as session:
        for variable in tf.compat.v1.global_variables():
          if variable.op.name in values:
            variable.load(values[variable.op.name], session)
        session.run(tf.compat.v1.local_variables_initializer())
        result[key] = session.run(
            spec.loss if mode == EVAL else spec.predictions, feed)
  return result


def _assert_one_device(expected, actual, tolerance=1e-5):
  close = lambda a, b, what: np.testing.assert_allclose(
      a, b, rtol=tolerance, atol=tolerance, err_msg=what)
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  for name, value in expected["variables"].items():
    close(actual["variables"][name], value, name)
  close(actual["eval_loss"], expected["eval_loss"], "eval loss")
  for name, value in expected["predictions"].items():
    close(actual["predictions"][name], value, "prediction " + name)


# (towers, rows, optimizer, strategy, static)
CELLS = [
    (2, 8, "sgd", PS, False), (3, 7, "adam", PS, True),
    (3, 7, "sgd", REPLICATED, False), (2, 8, "adam", REPLICATED, True),
    (3, 2, "sgd", PS, False), (3, 2, "adam", REPLICATED, True),
]


@pytest.mark.parametrize("towers,rows,optimizer,strategy,static", CELLS,
                         ids=["-".join(map(str, c)) for c in CELLS])
def test_in_batch_negatives_train_like_one_device(towers, rows, optimizer,
                                                   strategy, static):
  expected = _run(retrieval_model_fn, rows, optimizer=optimizer,
                  static=static)
  actual = _run(retrieval_model_fn, rows, towers, optimizer=optimizer,
                static=static, variable_strategy=strategy)
  _assert_one_device(expected, actual)
