"""The core promise: N towers train, evaluate and predict like one device.

Every model here starts from constant initial values, so the unwrapped
`model_fn` on one device and the wrapped one on 1, 2 or 3 towers start alike
without a shared checkpoint. After several steps on the same global batches,
every variable (optimizer slots and accumulators included, under identical
names) and every step's loss must agree to 1e-5 relative.
"""

import collections
import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction
STEPS = 5
PS, RR = "parameter_server", "round_robin"


def _assert_close(actual, expected, name=""):
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6,
                             err_msg=name)


def _tower_scopes(graph):
  """The `tower_i` name scopes the wrapper built, e.g. {'tower_1'}."""
  return {op.name.split("/")[0] for op in graph.get_operations()
          if re.match(r"tower_\d+/", op.name)}


# A dense + embedding model with two heads: dict features, dict labels.


def _batches(rows):
  """STEPS global batches of `rows` rows, the same for every run."""
  rng = np.random.RandomState(rows)
  return [{
      "x": rng.rand(rows, 4).astype(np.float32),
      # 3 ids per row from 5: repeats within a row and across rows.
      "ids": rng.randint(0, 5, size=(rows, 3)).astype(np.int64),
      "y": rng.rand(rows, 1).astype(np.float32),
      "class": rng.randint(0, 3, size=rows).astype(np.int32),
  } for _ in range(STEPS)]


def _make_model_fn(reduction, optimizer_name):
  """The model's own losses use `reduction`, as replicate_model_fn is told."""

  def model_fn(features, labels, mode):
    table = tf.compat.v1.get_variable(
        "embedding", [5, 2],
        initializer=tf.compat.v1.constant_initializer(
            np.linspace(-1.0, 1.0, 10).reshape(5, 2)))
    # A gather: IndexedSlices gradients, with repeated ids in each batch.
    embedded = tf.reduce_sum(tf.nn.embedding_lookup(table, features["ids"]),
                             axis=1)
    inputs = tf.concat([features["x"], embedded], axis=1)
    hidden = tf.compat.v1.layers.dense(
        inputs, 3, tf.nn.tanh, name="hidden",
        kernel_initializer=tf.compat.v1.constant_initializer(
            np.linspace(-0.5, 0.5, 18).reshape(6, 3)))
    value = tf.compat.v1.layers.dense(
        hidden, 1, name="value",
        kernel_initializer=tf.compat.v1.constant_initializer(0.3))
    logits = tf.compat.v1.layers.dense(
        hidden, 3, name="logits",
        kernel_initializer=tf.compat.v1.constant_initializer(
            np.linspace(0.4, -0.4, 9).reshape(3, 3)))
    loss = (tf.compat.v1.losses.mean_squared_error(
        labels["y"], value, reduction=reduction) +
            tf.compat.v1.losses.sparse_softmax_cross_entropy(
                labels["class"], logits, reduction=reduction))
    # Small steps: a diverging run would magnify rounding differences.
    optimizer = (tf.compat.v1.train.AdamOptimizer(0.05)
                 if optimizer_name == "adam" else
                 tf.compat.v1.train.GradientDescentOptimizer(
                     0.01 if reduction == Reduction.SUM else 0.1))
    train_op = replicate.TowerOptimizer(optimizer).minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


class _Training:
  """What a run did: per-step losses, final variables, names, placement."""

  def __init__(self, losses, values, global_names, trainable_names,
               variable_devices, tower_scopes, local_values):
    self.losses = losses
    self.values = values  # op name -> value, every global variable
    self.local_values = local_values  # op name -> value, local variables
    self.global_names = global_names  # in creation order
    self.trainable_names = trainable_names
    self.variable_devices = variable_devices
    self.tower_scopes = tower_scopes


def _train(model_fn, batches, is_static_shape=False):
  """Runs one step per batch, fed through placeholders."""
  rows = len(batches[0]["x"]) if is_static_shape else None
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    inputs = {
        "x": tf.compat.v1.placeholder(tf.float32, [rows, 4]),
        "ids": tf.compat.v1.placeholder(tf.int64, [rows, 3]),
        "y": tf.compat.v1.placeholder(tf.float32, [rows, 1]),
        "class": tf.compat.v1.placeholder(tf.int32, [rows]),
    }
    spec = model_fn({"x": inputs["x"], "ids": inputs["ids"]},
                    {"y": inputs["y"], "class": inputs["class"]}, TRAIN)
    variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(config=session_config(3)) as session:
      # As the Estimator's Scaffold does: global, then local variables
      # (replicated towers' copies are local, initialised from tower 0's).
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      losses = [
          session.run([spec.loss, spec.train_op],
                      {inputs[k]: batch[k] for k in inputs})[0]
          for batch in batches
      ]
      values = session.run({v.op.name: v for v in variables})
      local_values = session.run(
          {v.op.name: v for v in tf.compat.v1.local_variables()})
    return _Training(
        losses, values, [v.op.name for v in variables],
        [v.op.name for v in tf.compat.v1.trainable_variables()],
        {v.device for v in tf.compat.v1.trainable_variables()},
        _tower_scopes(graph), local_values)


def _assert_same_training(got, expected, steps=STEPS):
  assert got.global_names == expected.global_names  # slots; nothing added
  assert got.trainable_names == expected.trainable_names
  assert got.values["global_step"] == expected.values["global_step"] == steps
  for name, value in got.values.items():
    assert np.all(np.isfinite(value)), name
  assert np.all(np.isfinite(got.losses)), got.losses
  _assert_close(got.losses, expected.losses, "loss per step")
  for name, value in expected.values.items():
    _assert_close(got.values[name], value, name)


@functools.lru_cache(maxsize=None)
def _unwrapped(reduction, optimizer_name, rows):
  return _train(_make_model_fn(reduction, optimizer_name), _batches(rows))


# (towers, variable_strategy, static batch shape): each tower count meets
# both strategies and both a known and an unknown batch size.
CONFIGS = [(1, PS, False), (2, PS, False), (2, RR, True), (3, PS, True),
           (3, RR, False)]


@pytest.mark.parametrize("towers, strategy, is_static_shape", CONFIGS,
                         ids=["1", "2ps", "2rr-static", "3ps-static", "3rr"])
@pytest.mark.parametrize("rows", [12, 7, 2], ids=["even", "uneven", "small"])
@pytest.mark.parametrize("optimizer_name", ["adam", "sgd"])
@pytest.mark.parametrize("reduction", [
    Reduction.SUM, Reduction.MEAN, Reduction.SUM_BY_NONZERO_WEIGHTS
])
def test_towers_train_like_one_device(reduction, optimizer_name, rows, towers,
                                      strategy, is_static_shape):
  # rows=7: shards 4, 3 (2 towers) and 3, 2, 2 (3 towers); rows=2 with 3
  # towers: 1, 1, 0, one tower with no rows, which must weigh 0, not NaN.
  expected = _unwrapped(reduction, optimizer_name, rows)
  if optimizer_name == "adam":  # the slot names the comparison relies on
    assert {"beta1_power", "beta2_power", "embedding/Adam",
            "embedding/Adam_1", "hidden/kernel/Adam"} <= set(
                expected.global_names)
  wrapped = replicate.replicate_model_fn(
      _make_model_fn(reduction, optimizer_name), loss_reduction=reduction,
      devices=cpus(towers), variable_strategy=strategy)
  got = _train(wrapped, _batches(rows), is_static_shape)
  assert got.tower_scopes == {"tower_{}".format(i) for i in range(1, towers)}
  if towers > 1:  # the strategy really placed the variables
    expected_devices = ({"/device:CPU:0"} if strategy == PS else
                        {"/device:CPU:{}".format(i) for i in range(towers)})
    assert got.variable_devices == expected_devices
  _assert_same_training(got, expected)


def test_the_embedding_gradient_the_matrix_sums_is_sparse():
  # The premise of the matrix above: the table's gradient is IndexedSlices,
  # one row per looked-up id, repeats kept (12 rows x 3 ids = 36 rows).
  batch = _batches(12)[0]
  with tf.Graph().as_default():
    spec = _make_model_fn(Reduction.MEAN, "sgd")(
        {"x": tf.constant(batch["x"]), "ids": tf.constant(batch["ids"])},
        {"y": tf.constant(batch["y"]), "class": tf.constant(batch["class"])},
        TRAIN)
    table = [v for v in tf.compat.v1.trainable_variables()
             if v.op.name == "embedding"][0]
    gradient, = tf.compat.v1.gradients(spec.loss, [table])
  assert isinstance(gradient, tf.IndexedSlices)
  assert gradient.indices.shape.as_list() == [36]
  assert len(set(batch["ids"].ravel())) < 36  # repeated ids


# One step of a one-weight model, worked by hand.


def _linear_model_fn(reduction, learning_rate):

  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [],
                                  initializer=tf.compat.v1.ones_initializer())
    loss = tf.compat.v1.losses.mean_squared_error(labels, w * features,
                                                  reduction=reduction)
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate)).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize(
    "reduction, learning_rate, x, towers, expected_loss, expected_w",
    [
        # mean((w x)^2) = (1 + 4 + 9) / 3 = 14/3; d/dw = 2 * 14/3 = 28/3;
        # w = 1 - 0.3 * 28/3 = -1.8. Shards [1, 2] and [3]: tower losses 5/2
        # and 9, weighted 2/3 and 1/3 -> 5/3 + 3 = 14/3. (An unweighted
        # average of the tower means would give 5.75 and w = -2.45.)
        (Reduction.MEAN, 0.3, [1.0, 2.0, 3.0], 2, 14 / 3, -1.8),
        (Reduction.SUM_BY_NONZERO_WEIGHTS, 0.3, [1.0, 2.0, 3.0], 2, 14 / 3,
         -1.8),
        # sum((w x)^2) = 14; d/dw = 2 * 14 = 28; w = 1 - 0.05 * 28 = -0.4.
        (Reduction.SUM, 0.05, [1.0, 2.0, 3.0], 2, 14.0, -0.4),
        # Shards [1], [2], []: mean = (1 + 4) / 2 = 2.5; d/dw = 2 * 2.5 = 5;
        # w = 1 - 0.3 * 5 = -0.5. The empty tower adds nothing.
        (Reduction.MEAN, 0.3, [1.0, 2.0], 3, 2.5, -0.5),
        # sum = 5; d/dw = 10; w = 1 - 0.05 * 10 = 0.5.
        (Reduction.SUM, 0.05, [1.0, 2.0], 3, 5.0, 0.5),
    ])
def test_one_step_by_hand(reduction, learning_rate, x, towers, expected_loss,
                          expected_w):
  wrapped = replicate.replicate_model_fn(
      _linear_model_fn(reduction, learning_rate), loss_reduction=reduction,
      devices=cpus(towers))
  with tf.Graph().as_default() as graph:
    spec = wrapped(tf.constant(x), tf.zeros([len(x)]), TRAIN)
    assert _tower_scopes(graph) == {
        "tower_{}".format(i) for i in range(1, towers)}
    w = tf.compat.v1.trainable_variables()[0]
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      loss, _ = session.run([spec.loss, spec.train_op])
      new_w, step = session.run(
          [w, tf.compat.v1.train.get_global_step()])
  assert loss == pytest.approx(expected_loss, rel=1e-5)
  assert new_w == pytest.approx(expected_w, rel=1e-5)
  assert step == 1


# SparseTensor features, split by row, unevenly and below the tower count.


def _sparse_model_fn(features, labels, mode):
  table = tf.compat.v1.get_variable(
      "table", [6, 2],
      initializer=tf.compat.v1.constant_initializer(
          np.linspace(0.0, 1.0, 12).reshape(6, 2)))
  embedded = tf.compat.v1.nn.safe_embedding_lookup_sparse(
      table, features["ids"], combiner="sqrtn")
  # A dense feature next to the sparse one: a shard whose sparse rows did
  # not line up with its dense rows would train differently.
  inputs = tf.concat([tf.reshape(embedded, [-1, 2]), features["x"]], axis=1)
  output = tf.compat.v1.layers.dense(
      inputs, 1, name="output",
      kernel_initializer=tf.compat.v1.constant_initializer([[0.5], [-0.3],
                                                            [0.8]]))
  loss = tf.compat.v1.losses.mean_squared_error(labels, output)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.2)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _sparse_batches():
  """Batches of 7, 2, 7, 5 rows; row r holds r % 3 ids (some rows empty)."""
  rng = np.random.RandomState(3)
  batches = []
  for rows in (7, 2, 7, 5):
    indices = [[r, k] for r in range(rows) for k in range(r % 3)]
    ids = tf.compat.v1.SparseTensorValue(
        np.array(indices, np.int64).reshape(-1, 2),
        rng.randint(0, 6, size=len(indices)).astype(np.int64), [rows, 2])
    batches.append((ids, rng.rand(rows, 1).astype(np.float32),
                    rng.rand(rows, 1).astype(np.float32)))
  return batches


def _train_sparse(model_fn, batches):
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    ids = tf.compat.v1.sparse_placeholder(tf.int64)
    x = tf.compat.v1.placeholder(tf.float32, [None, 1])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    spec = model_fn({"ids": ids, "x": x}, y, TRAIN)
    variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(config=session_config(3)) as session:
      # As the Estimator's Scaffold does: global, then local variables
      # (replicated towers' copies are local, initialised from tower 0's).
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      losses = [
          session.run([spec.loss, spec.train_op], {
              ids: sparse,
              x: dense,
              y: labels
          })[0] for sparse, dense, labels in batches
      ]
      values = session.run({v.op.name: v for v in variables})
      local_values = session.run(
          {v.op.name: v for v in tf.compat.v1.local_variables()})
    return _Training(losses, values, [v.op.name for v in variables],
                     [v.op.name for v in tf.compat.v1.trainable_variables()],
                     None, _tower_scopes(graph), local_values)


@pytest.fixture(scope="module")
def sparse_unwrapped():
  return _train_sparse(_sparse_model_fn, _sparse_batches())


@pytest.mark.parametrize("towers, strategy", [(2, PS), (3, PS), (3, RR),
                                              (3, "replicated")])
def test_sparse_tensor_features_train_like_one_device(sparse_unwrapped,
                                                      towers, strategy):
  # 7 rows: 4, 3 or 3, 2, 2; 2 rows on 3 towers: 1, 1, 0; 5 rows: 3, 2 or
  # 2, 2, 1.
  wrapped = replicate.replicate_model_fn(
      _sparse_model_fn, devices=cpus(towers), variable_strategy=strategy)
  got = _train_sparse(wrapped, _sparse_batches())
  assert got.tower_scopes == {"tower_{}".format(i) for i in range(1, towers)}
  assert "table/Adagrad" in got.global_names
  _assert_same_training(got, sparse_unwrapped, steps=4)


# Graph hygiene: the collections are the unwrapped model_fn's.


def _eval_model_fn(features, labels, mode):
  """w * x, scored against integer labels; w = 1 unless trained."""
  w = tf.compat.v1.get_variable("w", [],
                                initializer=tf.compat.v1.ones_initializer())
  value = w * features
  classes = tf.cast(value > 0.0, tf.int64)
  loss = tf.compat.v1.losses.mean_squared_error(tf.cast(labels, tf.float32),
                                                value)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, eval_metric_ops={
          "accuracy": tf.compat.v1.metrics.accuracy(labels, classes),
          "mean": tf.compat.v1.metrics.mean(features),
      })


def _collections(graph):
  """Collection key -> how often each name occurs, `tower_i` scopes removed.

  Towers 1..N-1 may add their own copies of what tower 0 adds (metric
  variables, for instance): with `tower_i` removed these are tower 0's names.
  Anything else, named or not, is something the unwrapped model_fn never
  makes.
  """

  def name_of(item):
    name = getattr(item, "name", None)
    if not isinstance(name, str):
      return "<{}>".format(type(item).__name__)
    return "/".join(part for part in name.split("/")
                    if not re.match(r"tower_\d+$", part))

  return {key: collections.Counter(name_of(item)
                                   for item in graph.get_collection(key))
          for key in graph.get_all_collection_keys()}


@pytest.mark.parametrize("mode", [TRAIN, EVAL])
def test_no_collection_holds_anything_of_the_wrapper(mode):
  model_fn = (_make_model_fn(Reduction.SUM_BY_NONZERO_WEIGHTS, "adam")
              if mode == TRAIN else _eval_model_fn)
  batch = _batches(7)[0]
  if mode == TRAIN:
    features = {"x": batch["x"], "ids": batch["ids"]}
    labels = {"y": batch["y"], "class": batch["class"]}
  else:
    features, labels = batch["x"][:, 0], batch["class"]

  def build(function):
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.get_or_create_global_step()
      function(tf.nest.map_structure(tf.constant, features),
               tf.nest.map_structure(tf.constant, labels), mode)
    return graph

  unwrapped_graph = build(model_fn)
  wrapped_graph = build(replicate.replicate_model_fn(model_fn,
                                                     devices=cpus(3)))
  assert _tower_scopes(wrapped_graph) == {"tower_1", "tower_2"}
  unwrapped = _collections(unwrapped_graph)
  wrapped = _collections(wrapped_graph)
  # Each collection holds tower 0's items once (shared, like the variables)
  # or once per tower (tower-local, like metric variables): nothing else.
  differences = {
      key: {"wrapped": sorted(wrapped.get(key, {}).items()),
            "unwrapped": sorted(unwrapped.get(key, {}).items())}
      for key in set(wrapped) | set(unwrapped)
      if wrapped.get(key) not in (
          unwrapped.get(key),
          collections.Counter({name: 3 * count for name, count in
                               unwrapped.get(key, {}).items()}))
  }
  assert sorted(wrapped) == sorted(unwrapped), differences
  assert not differences, differences
  # Towers share tower 0's variables: the very same global and trainable
  # variables, in the same order, and no variable of the wrapper's.
  for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
              tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
    assert [v.op.name for v in wrapped_graph.get_collection(key)] == [
        v.op.name for v in unwrapped_graph.get_collection(key)]
  if mode == EVAL:  # the metric variables really are one set per tower
    assert wrapped[tf.compat.v1.GraphKeys.LOCAL_VARIABLES] == (
        collections.Counter({"accuracy/total:0": 3, "accuracy/count:0": 3,
                             "mean/total:0": 3, "mean/count:0": 3}))


# EVAL: metrics over the whole batch, accumulating, no side effect on read.


def test_metrics_over_an_uneven_batch_on_three_towers_are_whole_batch():
  wrapped = replicate.replicate_model_fn(_eval_model_fn, devices=cpus(3))
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None])
    y = tf.compat.v1.placeholder(tf.int64, [None])
    spec = wrapped(x, y, EVAL)
    assert _tower_scopes(graph) == {"tower_1", "tower_2"}
    values = {k: value for k, (value, _) in spec.eval_metric_ops.items()}
    updates = [update for _, update in spec.eval_metric_ops.values()]
    scaffold = tf.compat.v1.train.Scaffold()
    scaffold.finalize()
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(scaffold.init_op)
      session.run(scaffold.local_init_op)
      # 7 rows, shards of 3, 2, 2. Classes (x > 0): 1 0 1 1 0 1 1 against
      # labels 1 0 0 1 1 1 1: rows 2 and 4 wrong -> accuracy 5/7 (the mean
      # of the towers' accuracies, (2/3 + 1/2 + 2/2) / 3, would be 0.722).
      # mean(x) = (0.5 - 1 + 2 + 3 - 2 + 1 + 4) / 7 = 7.5 / 7.
      # loss = mean((x - label)^2) = (0.25 + 1 + 4 + 4 + 9 + 0 + 9) / 7
      #      = 27.25 / 7.
      first = {x: [0.5, -1.0, 2.0, 3.0, -2.0, 1.0, 4.0],
               y: [1, 0, 0, 1, 1, 1, 1]}
      loss = session.run(spec.loss, first)
      assert loss == pytest.approx(27.25 / 7, rel=1e-5)
      session.run(updates, first)
      once = session.run(values)
      assert session.run(values) == once  # reading has no side effect
      assert once["accuracy"] == pytest.approx(5 / 7, rel=1e-5)
      assert once["mean"] == pytest.approx(7.5 / 7, rel=1e-5)
      # 2 more rows, shards of 1, 1, 0 (tower 2 has none): classes 0 1
      # against labels 0 0 -> 1 right; over both batches 6/9; mean(x) over
      # both = (7.5 - 3 + 6) / 9 = 10.5 / 9. loss = (9 + 36) / 2 = 22.5.
      second = {x: [-3.0, 6.0], y: [0, 0]}
      assert session.run(spec.loss, second) == pytest.approx(22.5, rel=1e-5)
      session.run(updates, second)
      twice = session.run(values)
      assert session.run(values) == twice
  assert twice["accuracy"] == pytest.approx(6 / 9, rel=1e-5)
  assert twice["mean"] == pytest.approx(10.5 / 9, rel=1e-5)


# PREDICT: predictions and every kind of export output, row by row, in order.


def _predict_model_fn(features, labels, mode):
  del labels
  logits = tf.compat.v1.layers.dense(
      tf.convert_to_tensor(features["x"]), 3, name="logits",
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-1.0, 1.0, 6).reshape(2, 3)),
      bias_initializer=tf.compat.v1.constant_initializer([0.1, 0.0, -0.1]))
  probabilities = tf.nn.softmax(logits)
  row = tf.convert_to_tensor(features["row"])
  classes = tf.strings.as_string(row[:, None] * [1, 10, 100])  # [n, 3]
  return tf.estimator.EstimatorSpec(
      mode, predictions={
          "probabilities": probabilities,
          "class_ids": tf.argmax(logits, axis=1),
          "row": row,
      }, export_outputs={
          "serving_default": tf.estimator.export.PredictOutput({
              "probabilities": probabilities,
              "row": row
          }),
          "regression": tf.estimator.export.RegressionOutput(logits[:, :1]),
          "classification": tf.estimator.export.ClassificationOutput(
              scores=probabilities, classes=classes),
      })


def _predict(model_fn, towers):
  rng = np.random.RandomState(5)
  # numpy values, not placeholders: a PREDICT graph fed by placeholders is
  # a serving graph, which the wrapper builds as one tower.
  features = {"x": rng.randn(7, 2).astype(np.float32),
              "row": np.arange(7, dtype=np.int64)}
  with tf.Graph().as_default() as graph:
    spec = model_fn(features, None, PREDICT)
    outputs = spec.export_outputs
    fetches = {
        "predictions": spec.predictions,
        "predict_output": outputs["serving_default"].outputs,
        "regression": outputs["regression"].value,
        "scores": outputs["classification"].scores,
        "classes": outputs["classification"].classes,
    }
    with tf.compat.v1.Session(config=session_config(3)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(fetches), _tower_scopes(graph)


def test_predictions_and_export_outputs_line_up_with_the_rows():
  expected, _ = _predict(_predict_model_fn, 1)
  got, scopes = _predict(
      replicate.replicate_model_fn(_predict_model_fn, devices=cpus(3)), 3)
  assert scopes == {"tower_1", "tower_2"}  # 7 rows as 3, 2, 2
  assert got["predictions"]["row"].tolist() == list(range(7))
  assert got["predict_output"]["row"].tolist() == list(range(7))
  # Row r's classes are r, 10 r, 100 r: e.g. row 6 -> 6, 60, 600.
  assert got["classes"].tolist() == [
      [str(r).encode(), str(10 * r).encode(), str(100 * r).encode()]
      for r in range(7)
  ]
  assert got["predictions"]["class_ids"].tolist() == expected["predictions"][
      "class_ids"].tolist()
  for key in ("probabilities",):
    _assert_close(got["predictions"][key], expected["predictions"][key], key)
    _assert_close(got["predict_output"][key], expected["predict_output"][key],
                  key)
  _assert_close(got["regression"], expected["regression"], "regression")
  _assert_close(got["scores"], expected["scores"], "scores")
  assert got["regression"].shape == (7, 1)
  assert got["scores"].shape == (7, 3)
