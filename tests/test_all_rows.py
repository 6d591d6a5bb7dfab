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

import inspect

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


def _features(batches, static):
  """The batches from a dataset, as an input_fn gives them: of unknown size,
  or of known size (`drop_remainder`) when `static`."""
  q = np.concatenate([b[0] for b in batches])
  d = np.concatenate([b[1] for b in batches])
  dataset = tf.data.Dataset.from_tensor_slices({"q": q, "d": d}).batch(
      len(batches[0][0]), drop_remainder=static)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _wrapped(model_fn, towers, **kwargs):
  if towers is None:
    return model_fn
  return replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                      **kwargs)


def _run(model_fn, rows, towers=None, optimizer="sgd", static=False,
         **kwargs):
  """{"variables": after STEPS steps, "eval_loss", "predictions"}.

  Each mode in its own graph, as the Estimator builds them; EVAL and
  PREDICT read the trained variables, on the last batch.
  """
  batches = _batches(rows)
  params = {"optimizer": optimizer}
  result = {}
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    spec = _wrapped(model_fn, towers, **kwargs)(
        features=_features(batches, static), labels=None, mode=TRAIN,
        params=params)
    with tf.compat.v1.Session(config=session_config(4)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in batches:
        session.run(spec.train_op)
      values = {v.op.name: session.run(v)
                for v in tf.compat.v1.global_variables()}
  result["variables"] = {name: value for name, value in values.items()
                         if not name.startswith("tower_")}
  for mode, key in ((EVAL, "eval_loss"), (PREDICT, "predictions")):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      spec = _wrapped(model_fn, towers, **kwargs)(
          features=_features(batches[-1:], static), labels=None, mode=mode,
          params=params)
      with tf.compat.v1.Session(config=session_config(4)) as session:
        for variable in tf.compat.v1.global_variables():
          if variable.op.name in values:
            variable.load(values[variable.op.name], session)
        session.run(tf.compat.v1.local_variables_initializer())
        result[key] = session.run(
            spec.loss if mode == EVAL else spec.predictions)
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


def _build(model_fn, towers=2, mode=TRAIN, rows=6, **kwargs):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    features = {"q": tf.constant(np.ones((rows, DIM), np.float32)),
                "d": tf.constant(np.ones((rows, DIM), np.float32))}
    labels = tf.constant(np.arange(rows) % 3, tf.int32)
    params = ({"optimizer": "sgd"} if "params" in
              inspect.signature(model_fn).parameters else None)
    return replicate.replicate_model_fn(model_fn, devices=cpus(towers),
                                        **kwargs)(
        features=features, labels=labels, mode=mode, params=params)


@pytest.mark.parametrize("mode", [TRAIN, EVAL])
def test_in_batch_negatives_without_all_rows_are_refused(mode):
  with pytest.raises(ValueError, match=r"MatMul op 'MatMul'.*"
                     r"replicate\.all_rows"):
    _build(per_shard_model_fn, mode=mode)


@pytest.mark.parametrize("towers", [2, 3])
def test_in_batch_predictions_without_all_rows_are_one_devices(towers):
  """With no loss to differentiate (PREDICT), the similarity over the batch
  is computed once on the whole batch's rows (it was refused on f65e512)."""
  rng = np.random.RandomState(3)
  values = {"q": rng.normal(size=(7, DIM)).astype(np.float32),
            "d": rng.normal(size=(7, DIM)).astype(np.float32)}

  def predicted(count):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      features = {key: tf.compat.v1.placeholder(tf.float32, [None, DIM])
                  for key in values}
      model_fn = per_shard_model_fn if count is None else (
          replicate.replicate_model_fn(per_shard_model_fn,
                                       devices=cpus(count)))
      spec = model_fn(features=features, labels=None, mode=PREDICT,
                      params={"optimizer": "sgd"})
      with tf.compat.v1.Session(config=session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(spec.predictions, {
            features[key]: value for key, value in values.items()})

  expected = predicted(None)
  got = predicted(towers)
  np.testing.assert_array_equal(got["best"], expected["best"])
  np.testing.assert_allclose(got["q"], expected["q"], rtol=1e-6)


VALUES = "test_all_rows.values"


def _seen_model_fn(features, labels, mode):
  """Records what each tower's all_rows and row_offset give."""
  tf.compat.v1.add_to_collection(VALUES, (
      replicate.all_rows(features["q"]), replicate.all_rows(labels),
      replicate.row_offset()))
  q, d = _towers(features)
  sim = tf.matmul(q, replicate.all_rows(d), transpose_b=True)
  labels = tf.range(tf.shape(q)[0]) + replicate.row_offset()
  return _spec(mode, q, sim, labels, "sgd")


@pytest.mark.parametrize("towers,rows,static", [(3, 7, False), (3, 7, True),
                                                (3, 2, False), (2, 1, True)])
@pytest.mark.parametrize("mode", [TRAIN, PREDICT])
def test_every_tower_sees_the_whole_batch_in_input_order(towers, rows, static,
                                                         mode):
  q = np.arange(rows * DIM, dtype=np.float32).reshape(rows, DIM)
  labels = np.arange(rows, dtype=np.int32) * 10
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices(
        ({"q": q, "d": q}, labels)).batch(rows, drop_remainder=static)
    features, label_tensor = tf.compat.v1.data.make_one_shot_iterator(
        dataset).get_next()
    replicate.replicate_model_fn(_seen_model_fn, devices=cpus(towers))(
        features=features, labels=label_tensor, mode=mode)
    seen = graph.get_collection(VALUES)
    assert len(seen) == towers
    for index, (whole, _, _) in enumerate(seen):
      assert whole.device.endswith("CPU:{}".format(index))
    with tf.compat.v1.Session(config=session_config(4)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      values = session.run(seen)
  sizes = [len(part) for part in np.array_split(np.arange(rows), towers)]
  offsets = [sum(sizes[:i]) if size else 0 for i, size in enumerate(sizes)]
  for (whole, whole_labels, offset), expected in zip(values, offsets):
    np.testing.assert_array_equal(whole, q)
    np.testing.assert_array_equal(whole_labels, labels)
    assert offset == expected


def test_outside_the_wrapper_and_with_one_tower_they_are_the_identity():
  with tf.Graph().as_default():
    tensor = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    assert replicate.all_rows(tensor) is tensor
    offset = replicate.row_offset()
    assert offset.dtype == tf.int32
    assert tf.compat.v1.Session().run(offset) == 0
  expected = _run(retrieval_model_fn, 5)
  actual = _run(retrieval_model_fn, 5, 1)
  _assert_one_device(expected, actual, tolerance=0)


def _refused_model_fn(combine):
  def model_fn(features, labels, mode):
    q, _ = _towers(features)
    logits = combine(q, labels)
    loss = tf.reduce_mean(logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, predictions={"q": q}, train_op=optimizer.minimize(
            loss, global_step=tf.compat.v1.train.get_global_step()))
  return model_fn


REFUSED = {
    "gram": (lambda q, y: tf.matmul(q, q, transpose_a=True), "MatMul"),
    "top_k_over_rows": (
        lambda q, y: q * tf.reduce_sum(tf.math.top_k(q[:, 0], 2).values),
        "TopKV2"),
    "sort_axis_0": (lambda q, y: tf.sort(q, axis=0), "TopKV2"),
    "cumsum_axis_0": (lambda q, y: tf.cumsum(q, axis=0), "Cumsum"),
    # In-batch negatives through einsum: silently off before (review).
    "einsum_negatives": (lambda q, y: tf.einsum("id,jd->ij", q, q),
                         "Einsum"),
    "einsum_over_rows": (lambda q, y: q * tf.einsum("id,id->d", q, q),
                         "Einsum"),
    "class_sums": (lambda q, y: tf.gather(
        tf.math.unsorted_segment_sum(q, y, 3), y), "UnsortedSegmentSum"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_ops_that_combine_rows_are_refused_with_the_op_and_the_fix(name):
  combine, op_type = REFUSED[name]
  with pytest.raises(ValueError, match=r"The {} op '[^']+' combines different "
                     r"rows.*replicate\.all_rows".format(op_type)):
    _build(_refused_model_fn(combine))


def _attention(q, y):
  keys = tf.reshape(tf.tile(q, [1, 2]), [-1, 2, 4])
  return tf.reduce_sum(tf.matmul(keys, keys, transpose_b=True), [1, 2])


def _row_index_segments(q, y):
  ids = tf.range(tf.shape(q)[0])
  return tf.math.unsorted_segment_sum(q, ids, tf.shape(q)[0])


def _sparse_embedding(q, y):
  ids = tf.sparse.from_dense(tf.reshape(y + 1, [-1, 1]))
  table = tf.compat.v1.get_variable("table", [4, 4])
  return q * tf.nn.embedding_lookup_sparse(table, ids, None, combiner="mean")


def _sampled_softmax(q, y):
  weights = tf.compat.v1.get_variable("out", [5, 4])
  return tf.nn.sampled_softmax_loss(
      weights, tf.zeros([5]), tf.cast(tf.reshape(y, [-1, 1]), tf.int64), q,
      num_sampled=2, num_classes=5, seed=1)


KEPT_APART = {
    "attention": _attention,
    "row_index_segments": _row_index_segments,
    "sparse_embedding": _sparse_embedding,
    "sampled_softmax": _sampled_softmax,
    "int_cumsum": lambda q, y: q * tf.cast(tf.cumsum(y), tf.float32)[:, None],
    "top_k_in_rows": lambda q, y: tf.math.top_k(q, 2).values,
    "einsum_within_rows": lambda q, y: tf.reduce_sum(
        tf.einsum("bi,bj->bij", q, q), 2),
}


@pytest.mark.parametrize("name", sorted(KEPT_APART))
def test_ops_that_keep_rows_apart_are_not_refused(name):
  # Sampled softmax's sampler is a random draw, like dropout: each tower
  # draws its own classes (docs/guarantees.md), and trains.
  mode = TRAIN
  spec = _build(_refused_model_fn(KEPT_APART[name]), towers=3, rows=7,
                mode=mode)
  assert spec.loss is not None


def test_a_gradient_made_outside_tower_optimizer_is_refused():
  def model_fn(features, labels, mode):
    q, d = _towers(features)
    sim = tf.matmul(q, replicate.all_rows(d), transpose_b=True)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.range(tf.shape(q)[0]) + replicate.row_offset(),
        logits=sim))
    tvars = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      train_op=optimizer.apply_gradients(
                                          zip(grads, tvars)))
  with pytest.raises(ValueError, match=r"gradient through replicate\.all_rows"
                     r".*outside TowerOptimizer.*Fix: use TowerOptimizer"):
    _build(model_fn)


def test_all_rows_inside_a_tf_function_is_refused():
  def model_fn(features, labels, mode):
    q, d = _towers(features)
    whole = tf.function(replicate.all_rows)(d)
    return _spec(mode, q, tf.matmul(q, whole, transpose_b=True),
                 tf.range(tf.shape(q)[0]), "sgd")
  with pytest.raises(ValueError, match=r"all_rows\(\) is called inside a "
                     r"tf\.function.*Fix"):
    _build(model_fn, mode=PREDICT)


def test_a_scalar_is_refused():
  def model_fn(features, labels, mode):
    q, d = _towers(features)
    replicate.all_rows(tf.reduce_sum(d))
    return _spec(mode, q, tf.matmul(q, q, transpose_b=True), labels, "sgd")
  with pytest.raises(ValueError, match=r"needs a tensor with the tower's rows "
                     r"in dimension 0.*scalar"):
    _build(model_fn, mode=PREDICT)


def _cond_on_rows(q, y):
  """TF 1 control flow: a cond whose predicate is a sum of the rows selects
  a variable through a `Switch`; the variable does not become rows."""
  weights = tf.compat.v1.get_variable("cond_weights", [4, 4])
  return tf.compat.v1.cond(tf.reduce_sum(q) > 0.0,
                           lambda: tf.matmul(q, weights),
                           lambda: tf.matmul(q, -weights))


def test_a_v1_cond_on_the_rows_is_not_refused():
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  tf.compat.v1.disable_control_flow_v2()
  try:
    spec = _build(_refused_model_fn(_cond_on_rows), towers=3, rows=7)
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()
  assert spec.train_op is not None


def test_the_features_themselves_are_rows():
  def model_fn(features, labels, mode):
    sim = tf.matmul(features["q"], features["d"], transpose_b=True)
    return _spec(mode, features["q"], sim, tf.range(tf.shape(sim)[0]), "sgd")
  with pytest.raises(ValueError, match=r"The MatMul op 'MatMul' combines"):
    _build(model_fn, mode=EVAL)


def test_a_differentiable_batch_mean_flowing_back_into_rows_is_refused():
  # No matmul of two row tensors: rows_meet lets it pass, but the batch's
  # mean of q flows back into every row on the way to the loss, and its
  # gradient cannot be one device's (replicate.shard.batch_reductions).
  with pytest.raises(ValueError, match=r"reduction 'Mean'.*all_rows"):
    _build(_refused_model_fn(lambda q, y: tf.matmul(
        q, tf.reduce_mean(q, 0, keepdims=True), transpose_b=True)),
           towers=3, rows=7, mode=TRAIN)


def normalized_retrieval_model_fn(features, labels, mode, params):
  """In-batch negatives over documents through a batch norm, which the
  wrapper synchronizes: its moments are the whole batch's, of a value
  computed from variables."""
  del labels
  q, d = _towers(features)
  # tanh: else beta only shifts each row's scores, and has no gradient
  # but rounding's, which Adam would scale up.
  d = tf.nn.tanh(tf.compat.v1.layers.batch_normalization(
      d, training=mode == TRAIN, name="bn"))
  sim = tf.matmul(q, replicate.all_rows(d), transpose_b=True)
  labels = tf.range(tf.shape(q)[0]) + replicate.row_offset()
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    return _spec(mode, q, sim, labels, params["optimizer"])


@pytest.mark.parametrize("towers,rows,optimizer", [
    (2, 8, "sgd"), (3, 7, "adam")])
def test_replicated_with_a_synchronized_batch_norm_trains_like_one_device(
    towers, rows, optimizer):
  # "replicated" differentiates tower i's loss a second time, towards tower
  # 0's own variables, which its rows reach only through the batch norm's
  # whole-batch moments; that pass gets nothing through them. It was
  # refused as a second backward pass through all_rows in towers 1..N-1
  # ("tower 0: 1, tower 1: 2"), as TF-Ranking's groupwise scoring met it.
  expected = _run(normalized_retrieval_model_fn, rows, optimizer=optimizer)
  actual = _run(normalized_retrieval_model_fn, rows, towers,
                optimizer=optimizer, variable_strategy=REPLICATED)
  assert "bn/moving_mean" in expected["variables"]
  _assert_one_device(expected, actual)
