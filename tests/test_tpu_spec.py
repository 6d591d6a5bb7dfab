"""A model_fn returning TPUEstimatorSpec, as BERT's does with use_tpu=False.

Its `eval_metrics` metric_fn is called once on the whole batch's tensors (a
corpus score through py_func is one device's), its `scaffold_fn` once; it
trains and evaluates like the unwrapped model_fn on one device, under
`Estimator` and under `TPUEstimator(use_tpu=False)`.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import cpus, session_config, checkpoint_values

tpu = tf.compat.v1.estimator.tpu
TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL

ROWS = 12
BATCH = 7  # batches of 7 and 5 rows: uneven on 2 and 3 towers
_rng = np.random.RandomState(30)
X = _rng.randn(ROWS, 4).astype(np.float32)
LABEL = _rng.randint(0, 3, size=ROWS).astype(np.int32)
REAL = np.array([1] * 10 + [0] * 2, np.float32)  # two padding examples
HIDDEN = _rng.randn(4, 5).astype(np.float32)
OUTPUT = _rng.randn(5, 3).astype(np.float32)


def _corpus_score(logits, labels):
  """A score of the whole batch at once (BLEU-like): not a mean of rows."""
  margins = logits[np.arange(len(labels)), labels] - logits.max(axis=1)
  return np.float32(np.median(margins) + len(labels) / 10.0)


def bert_like_model_fn(features, labels, mode, params):
  """The shape of google-research/bert's run_classifier model_fn."""
  calls = params["scaffold_calls"]
  hidden = tf.compat.v1.layers.dense(
      features["x"], 5, activation=tf.tanh, name="hidden",
      kernel_initializer=tf.compat.v1.constant_initializer(HIDDEN))
  logits = tf.compat.v1.layers.dense(
      hidden, 3, name="output",
      kernel_initializer=tf.compat.v1.constant_initializer(OUTPUT))
  log_probs = tf.nn.log_softmax(logits, axis=-1)
  one_hot = tf.one_hot(labels, depth=3, dtype=tf.float32)
  per_example_loss = -tf.reduce_sum(one_hot * log_probs, axis=-1)
  loss = tf.reduce_mean(per_example_loss)
  init_checkpoint = params.get("init_checkpoint")

  def scaffold_fn():
    calls.append(mode)
    if init_checkpoint:
      tf.compat.v1.train.init_from_checkpoint(init_checkpoint,
                                              {"hidden/": "hidden/"})
    return tf.compat.v1.train.Scaffold()

  if mode == TRAIN:
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5))
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tpu.TPUEstimatorSpec(mode=mode, loss=loss, train_op=train_op,
                                scaffold_fn=scaffold_fn)

  def metric_fn(per_example_loss, label_ids, logits, is_real_example):
    predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
    corpus = tf.compat.v1.py_func(_corpus_score, [logits, label_ids],
                                  tf.float32, stateful=False)
    return {
        "eval_accuracy": tf.compat.v1.metrics.accuracy(
            labels=label_ids, predictions=predictions,
            weights=is_real_example),
        "eval_loss": tf.compat.v1.metrics.mean(values=per_example_loss,
                                               weights=is_real_example),
        "corpus_score": tf.compat.v1.metrics.mean(corpus),
    }

  eval_metrics = (metric_fn, [per_example_loss, labels, logits,
                              features["is_real_example"]])
  return tpu.TPUEstimatorSpec(mode=mode, loss=loss, eval_metrics=eval_metrics,
                              scaffold_fn=scaffold_fn)


def _input_fn(params):
  return tf.data.Dataset.from_tensor_slices(
      ({"x": X, "is_real_example": REAL}, LABEL)).batch(
          params.get("batch_size", BATCH))


def _estimator(kind, model_fn, model_dir, calls, init_checkpoint=None):
  params = {"scaffold_calls": calls, "init_checkpoint": init_checkpoint}
  if kind == "Estimator":
    return tf.estimator.Estimator(
        model_fn, model_dir=model_dir, params=params,
        config=tf.estimator.RunConfig(session_config=session_config()))
  return tpu.TPUEstimator(
      model_fn=model_fn, use_tpu=False, train_batch_size=BATCH,
      eval_batch_size=BATCH, params=params,
      config=tpu.RunConfig(model_dir=model_dir,
                           session_config=session_config()))


def _train_and_evaluate(estimator):
  estimator.train(_input_fn, steps=2)  # a batch of 7 rows, then one of 5
  metrics = estimator.evaluate(_input_fn, steps=2)
  return checkpoint_values(estimator.model_dir), metrics


@pytest.mark.parametrize("kind", ["Estimator", "TPUEstimator"])
@pytest.mark.parametrize("towers", [2, 3])
def test_bert_like_model_fn_trains_and_evaluates_like_one_device(
    kind, towers, tmp_path):
  start = str(tmp_path / "start")
  _estimator("TPUEstimator", bert_like_model_fn, start, []).train(
      _input_fn, steps=1)
  start = tf.train.latest_checkpoint(start)
  expected_calls, calls = [], []
  expected_values, expected = _train_and_evaluate(_estimator(
      "TPUEstimator", bert_like_model_fn, str(tmp_path / "one"),
      expected_calls, start))
  values, metrics = _train_and_evaluate(_estimator(
      kind, replicate.replicate_model_fn(bert_like_model_fn,
                                         devices=cpus(towers)),
      str(tmp_path / "wrapped"), calls, start))
  assert calls == expected_calls  # scaffold_fn once per model_fn call
  assert sorted(values) == sorted(expected_values)
  for name, value in expected_values.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # The run started from the checkpoint: init_from_checkpoint took effect.
  assert not np.allclose(expected_values["hidden/kernel"], HIDDEN)
  for key in ("eval_accuracy", "eval_loss", "corpus_score", "loss"):
    assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key


def _evaluated_once(model_fn, rows):
  """Every metric after one batch of `rows`, from fixed initial values."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    features = {"x": tf.constant(X[:rows]),
                "is_real_example": tf.constant(REAL[:rows])}
    spec = model_fn(features=features, labels=tf.constant(LABEL[:rows]),
                    mode=EVAL, params={"scaffold_calls": []})
    if isinstance(spec, tpu.TPUEstimatorSpec):
      spec = spec.as_estimator_spec()
    updates = [u for _, u in spec.eval_metric_ops.values()]
    values = {k: v for k, (v, _) in spec.eval_metric_ops.items()}
    with tf.compat.v1.Session(config=session_config()) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      session.run(updates)
      return session.run(values), sorted(v.op.name for v in
                                         tf.compat.v1.local_variables())


@pytest.mark.parametrize("towers,rows", [(2, 5), (3, 7), (3, 2)])
def test_metric_fn_is_called_once_on_the_whole_batch(towers, rows):
  expected, expected_names = _evaluated_once(bert_like_model_fn, rows)
  got, names = _evaluated_once(
      replicate.replicate_model_fn(bert_like_model_fn, devices=cpus(towers)),
      rows)
  assert names == expected_names  # one set of metric variables, unwrapped
  for key, value in expected.items():
    assert got[key] == pytest.approx(value, rel=1e-6), key
  # The corpus score is not a mean of the towers' scores.
  assert expected["corpus_score"] == pytest.approx(
      _corpus_score(_logits(rows), LABEL[:rows]), rel=1e-5)


def _logits(rows):
  return np.tanh(X[:rows] @ HIDDEN) @ OUTPUT


def test_scalar_of_the_rows_in_eval_metrics_is_refused(graph):
  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(tf.compat.v1.layers.dense(features, 1))
    return tpu.TPUEstimatorSpec(
        mode, loss=loss,
        eval_metrics=(lambda l: {"l": tf.compat.v1.metrics.mean(l)}, [loss]))

  with pytest.raises(ValueError, match=r"eval_metrics.*scalar.*batch-major"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([4, 2]), tf.ones([4, 1]), EVAL)


@pytest.mark.parametrize("rows", [4, None])
def test_a_loss_reshaped_to_one_row_in_eval_metrics_is_refused(graph, rows):
  # XLNet and ELECTRA pass tf.reshape(loss, [1]): concatenated over towers
  # it would be one value per tower, averaged as if they were rows (5.24
  # against one device's 5.40 on a 3 + 2 split).
  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(tf.compat.v1.layers.dense(features, 1))
    return tpu.TPUEstimatorSpec(
        mode, loss=loss,
        eval_metrics=(lambda l: {"l": tf.compat.v1.metrics.mean(l)},
                      [tf.reshape(loss, [1])]))

  features = tf.compat.v1.placeholder_with_default(
      tf.ones([4, 2]), [rows, 2])
  with pytest.raises(ValueError, match=r"eval_metrics.*not one row per "
                     r"input row.*reshape\(loss, \[1\]\).*batch-major"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        features, tf.ones([4, 1]), EVAL)


_HOST_CALL_SEEN = []  # TPUEstimator deep-copies params: not passed there


def _host_call_model_fn(features, labels, mode, params):
  """A host_call over the per-row losses, as TPU summaries code has."""
  del params
  seen = _HOST_CALL_SEEN
  logits = tf.compat.v1.layers.dense(
      features["x"], 3, name="output",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.ones([4, 3], np.float32)))
  per_example_loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, reduction=tf.compat.v1.losses.Reduction.NONE)
  loss = tf.reduce_mean(per_example_loss)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())

  def host_fn(per_example_loss):
    def record(values):
      seen.append(values.copy())
      return np.float32(0)
    return [tf.compat.v1.py_func(record, [per_example_loss], tf.float32)]

  return tpu.TPUEstimatorSpec(mode, loss=loss, train_op=train_op,
                              host_call=(host_fn, [per_example_loss]))


@pytest.mark.parametrize("towers", [2, 3])
def test_host_call_is_called_once_on_the_whole_batch(towers, tmp_path):
  def train(model_fn, name):
    del _HOST_CALL_SEEN[:]
    tpu.TPUEstimator(
        model_fn=model_fn, use_tpu=False, train_batch_size=BATCH,
        config=tpu.RunConfig(model_dir=str(tmp_path / name),
                             session_config=session_config())).train(
                                 _input_fn, steps=2)
    return list(_HOST_CALL_SEEN)

  expected = train(_host_call_model_fn, "one")
  got = train(replicate.replicate_model_fn(_host_call_model_fn,
                                           devices=cpus(towers)), "wrapped")
  assert [len(v) for v in expected] == [7, 5]
  assert len(got) == len(expected)
  for values, reference in zip(got, expected):
    np.testing.assert_allclose(values, reference, rtol=1e-6)
