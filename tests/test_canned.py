"""Canned estimators, TF 2 and compat.v1: wrapped == unwrapped, end to end.

Each estimator is trained one step unwrapped to make a shared starting
checkpoint (initial values depend on op creation order, which wrapping
changes), then trained further, evaluated and asked for predictions, both
unwrapped and wrapped with 3 towers (1 and 2 in `make test-oracle`), on 10
rows in batches of 4: the last batch has 2 rows, so 3 towers meet an uneven
batch and a tower without rows.
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import session_config

Reduction = tf.compat.v1.losses.Reduction
fc = tf.feature_column

ROWS = 10
_rng = np.random.RandomState(0)
X = _rng.rand(ROWS, 3).astype(np.float32)
COLOR = np.array(list("abcdabcdab")).reshape(ROWS, 1)
CLASS = np.arange(ROWS) % 3
VALUE = X.sum(axis=1, keepdims=True)


def _columns():
  color = fc.categorical_column_with_vocabulary_list("color", list("abcd"))
  return [fc.numeric_column("x", shape=[3])], color, fc.embedding_column(
      color, 2)


def _make(kind, family, model_dir, config=None, n_classes=3):
  """A canned estimator; the TF 2 ones take Keras legacy optimizers."""
  numeric, color, embedded = _columns()
  v2 = family == "v2"
  module = tf.estimator if v2 else tf.compat.v1.estimator
  optimizer = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.Adagrad(0.1)) if v2 else
      (lambda: tf.compat.v1.train.AdagradOptimizer(0.1)))
  common = dict(model_dir=model_dir, config=config)
  if kind == "DNNClassifier":
    return module.DNNClassifier([6, 4], numeric + [embedded],
                                n_classes=n_classes, optimizer=optimizer,
                                **common)
  if kind == "DNNRegressor":
    return module.DNNRegressor([4], numeric + [embedded], optimizer=optimizer,
                               **common)
  if kind == "LinearClassifier":
    return module.LinearClassifier(numeric + [color], n_classes=n_classes,
                                   optimizer=optimizer, **common)
  if kind == "LinearRegressor":
    return module.LinearRegressor(numeric + [color], optimizer=optimizer,
                                  **common)
  return module.DNNLinearCombinedClassifier(
      linear_feature_columns=[color], linear_optimizer=optimizer,
      dnn_feature_columns=numeric + [embedded], dnn_hidden_units=[4],
      dnn_optimizer=replicate.TowerOptimizer(
          (lambda: tf.keras.optimizers.legacy.Adam(0.01)) if v2 else
          (lambda: tf.compat.v1.train.AdamOptimizer(0.01))),
      n_classes=n_classes, **common)


def _wrapped(kind, family, model_dir, towers,
             variable_strategy="parameter_server", n_classes=3):
  canned = _make(kind, family, model_dir, n_classes=n_classes)
  # compat.v1 heads sum their loss over the batch; TF 2 heads average it.
  reduction = Reduction.SUM if family == "v1" else (
      Reduction.SUM_BY_NONZERO_WEIGHTS)
  return tf.estimator.Estimator(
      replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction,
                                   variable_strategy=variable_strategy),
      model_dir=model_dir,
      config=tf.estimator.RunConfig(session_config=session_config(towers)))


def _labels(kind, n_classes=3):
  return CLASS % n_classes if "Classifier" in kind else VALUE


def _train_input(kind, n_classes=3):
  return lambda: tf.data.Dataset.from_tensor_slices(
      ({"x": X, "color": COLOR}, _labels(kind, n_classes))).batch(4)


def _predict_input():
  return tf.data.Dataset.from_tensor_slices({"x": X, "color": COLOR}).batch(4)


def _outcome(estimator, kind):
  """Train 3 more steps (batches of 4, 4, 2), evaluate, predict."""
  estimator.train(_train_input(kind))
  metrics = estimator.evaluate(_train_input(kind))
  key = "probabilities" if "Classifier" in kind else "predictions"
  predictions = np.array([p[key] for p in estimator.predict(_predict_input)])
  return metrics, predictions, sorted(
      name for name, _ in tf.train.list_variables(estimator.model_dir))


CANNED = [(kind, family)
          for kind in ("DNNClassifier", "DNNRegressor", "LinearClassifier",
                       "LinearRegressor", "DNNLinearCombinedClassifier")
          for family in ("v2", "v1")]


@pytest.fixture(scope="module", params=CANNED, ids=lambda p: "-".join(p))
def reference(request, tmp_path_factory):
  """The shared starting checkpoint, and what the unwrapped estimator does."""
  kind, family = request.param
  start = str(tmp_path_factory.mktemp("start"))
  _make(kind, family, start).train(_train_input(kind), steps=1)
  unwrapped = str(tmp_path_factory.mktemp("unwrapped"))
  shutil.copytree(start, unwrapped, dirs_exist_ok=True)
  return kind, family, start, _outcome(_make(kind, family, unwrapped), kind)


# `make test` trains each estimator on 3 towers, where the last batch of 2
# is uneven and leaves a tower without rows, with two strategies; `make
# test-oracle` (which sets REPLICATE_ORACLE) on 1 and 2 towers, the
# oracle's zoo crossing canned estimators with every tower count already.
_TOWERS = ([(1, "parameter_server"), (2, "parameter_server")]
           if os.environ.get("REPLICATE_ORACLE") else
           [(3, "parameter_server"), (3, "replicated")])


@pytest.mark.parametrize("towers, strategy", _TOWERS, ids=[
    str(towers) + ("-replicated" if strategy == "replicated" else "")
    for towers, strategy in _TOWERS])
def test_wrapped_trains_evaluates_and_predicts_like_unwrapped(
    reference, towers, strategy, tmp_path):
  kind, family, start, (metrics, predictions, names) = reference
  shutil.copytree(start, tmp_path, dirs_exist_ok=True)
  got_metrics, got_predictions, got_names = _outcome(
      _wrapped(kind, family, str(tmp_path), towers, strategy), kind)
  assert got_names == names  # the checkpoint is the unwrapped one's
  assert got_metrics["global_step"] == metrics["global_step"] == 4
  for key in ("loss", "average_loss"):
    np.testing.assert_allclose(got_metrics[key], metrics[key], rtol=1e-5)
  if "accuracy" in metrics:
    assert got_metrics["accuracy"] == metrics["accuracy"]
  assert got_predictions.shape[0] == ROWS
  np.testing.assert_allclose(got_predictions, predictions, rtol=1e-5,
                             atol=1e-6)


_SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
export_dir, rows = sys.argv[1], json.loads(sys.argv[2])
x = np.array(rows["x"], np.float32)
color = np.array(rows["color"]).reshape(-1, 1)
served = {}
with tf.compat.v1.Session(graph=tf.Graph()) as session:  # one CPU, strict
  graph_def = tf.compat.v1.saved_model.load(session, ["serve"], export_dir)
  signature = graph_def.signature_def["predict"]
  output = rows["output"]
  for size in (1, 5, 12):
    served[size] = session.run(signature.outputs[output].name, {
        signature.inputs["x"].name: x[:size],
        signature.inputs["color"].name: color[:size]}).tolist()
print(json.dumps(served))
"""


@pytest.mark.parametrize("kind, family", [("DNNClassifier", "v2"),
                                          ("LinearRegressor", "v1")])
def test_export_serves_any_batch_size_in_a_fresh_process(kind, family,
                                                         tmp_path):
  model_dir = str(tmp_path / "model")
  wrapped = _wrapped(kind, family, model_dir, towers=3)
  wrapped.train(_train_input(kind))
  receiver = tf.estimator.export.build_raw_serving_input_receiver_fn({
      "x": tf.zeros([1, 3]), "color": tf.constant([["a"]])})
  export_dir = wrapped.export_saved_model(str(tmp_path / "export"),
                                          receiver).decode()
  rows = {"x": np.tile(X, (2, 1))[:12].tolist(),
          "color": np.tile(COLOR, (2, 1))[:12].ravel().tolist(),
          "output": "probabilities" if "Classifier" in kind else "predictions"}
  served = subprocess.run(
      [sys.executable, "-c", _SERVE, export_dir, json.dumps(rows)],
      capture_output=True, text=True, check=False,
      env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2"))
  assert served.returncode == 0, served.stderr[-3000:]
  served = json.loads(served.stdout.strip().splitlines()[-1])
  # The unwrapped estimator on the same checkpoint, 12 rows at once.
  unwrapped = _make(kind, family, model_dir)
  key = "probabilities" if "Classifier" in kind else "predictions"
  expected = np.array([p[key] for p in unwrapped.predict(
      lambda: tf.data.Dataset.from_tensor_slices(
          {"x": np.array(rows["x"], np.float32),
           "color": np.array(rows["color"]).reshape(-1, 1)}).batch(12))])
  for size in (1, 5, 12):
    np.testing.assert_allclose(served[str(size)], expected[:size], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("family, reduction, expected", [
    ("v1", Reduction.MEAN,
     "Pass loss_reduction=tf.compat.v1.losses.Reduction.SUM."),
    ("v2", Reduction.SUM, "Pass loss_reduction=tf.compat.v1.losses.Reduction"
     ".SUM_BY_NONZERO_WEIGHTS"),
])
def test_a_loss_reduction_unlike_the_heads_is_refused(family, reduction,
                                                      expected, tmp_path):
  canned = _make("DNNClassifier", family, str(tmp_path))
  with pytest.raises(ValueError, match=expected):
    replicate.replicate_model_fn(canned.model_fn, loss_reduction=reduction)


@pytest.fixture(scope="module")
def summing_v1(tmp_path_factory):
  """A compat.v1 DNNClassifier summing its loss, stated, trained one step
  (the shared start), then as `_outcome` trains it, unwrapped."""
  def make(model_dir):
    numeric, _, embedded = _columns()
    return tf.compat.v1.estimator.DNNClassifier(
        [6, 4], numeric + [embedded], n_classes=3, model_dir=model_dir,
        loss_reduction=Reduction.SUM,
        optimizer=replicate.TowerOptimizer(
            lambda: tf.compat.v1.train.AdagradOptimizer(0.1)))

  start = str(tmp_path_factory.mktemp("start"))
  make(start).train(_train_input("DNNClassifier"), steps=1)
  unwrapped = str(tmp_path_factory.mktemp("unwrapped"))
  shutil.copytree(start, unwrapped, dirs_exist_ok=True)
  return make, start, unwrapped, _outcome(make(unwrapped), "DNNClassifier")


@pytest.mark.parametrize("towers", [2, 3])
def test_a_v1_summing_head_trains_like_one_device_with_the_default(
    summing_v1, towers, tmp_path):
  # Refused until the loss rule read the graph: the default reduction now
  # reads the head's sum and counts it as it is. 10 rows in batches of 4:
  # the last batch of 2 leaves 3 towers uneven, one without rows.
  make, start, unwrapped, (metrics, predictions, names) = summing_v1
  shutil.copytree(start, tmp_path, dirs_exist_ok=True)
  wrapped = tf.estimator.Estimator(
      replicate.replicate_model_fn(make(str(tmp_path)).model_fn),
      model_dir=str(tmp_path),
      config=tf.estimator.RunConfig(session_config=session_config(towers)))
  got_metrics, got_predictions, got_names = _outcome(wrapped, "DNNClassifier")
  assert got_names == names
  assert got_metrics["global_step"] == metrics["global_step"] == 4
  for name in names:
    np.testing.assert_allclose(tf.train.load_variable(str(tmp_path), name),
                               tf.train.load_variable(unwrapped, name),
                               rtol=1e-5, atol=1e-6, err_msg=name)
  for key in ("loss", "average_loss", "accuracy"):
    np.testing.assert_allclose(got_metrics[key], metrics[key], rtol=1e-5)
  np.testing.assert_allclose(got_predictions, predictions, rtol=1e-5,
                             atol=1e-6)


def test_a_canned_estimator_not_trained_by_gradients_is_refused(tmp_path):
  kmeans = tf.compat.v1.estimator.experimental.KMeans(
      2, model_dir=str(tmp_path))
  with pytest.raises(ValueError, match="KMeansClustering is not trained by "
                     "gradients through an optimizer"):
    replicate.replicate_model_fn(kmeans.model_fn)


# The same checks through whatever wraps `estimator.model_fn`.

_GLOBAL_ESTIMATOR = None  # set by a test: a model_fn naming a global one


def _through_partial(estimator):
  return functools.partial(estimator.model_fn)


def _through_wrapped_attribute(estimator):
  class Logged:  # a callable object, as functools.update_wrapper leaves it
    def __init__(self, model_fn):
      functools.update_wrapper(self, model_fn)

    def __call__(self, features, labels, mode, config):
      return self.__wrapped__(features, labels, mode, config)

  return Logged(estimator.model_fn)


def _through_a_closure(estimator):
  def my_fn(features, labels, mode, config):
    return estimator.model_fn(features, labels, mode, config)

  return my_fn


def _through_a_closure_of_a_closure(estimator):
  inner = _through_a_closure(estimator)

  def outer(features, labels, mode, config):
    return inner(features, labels, mode, config)

  return outer


def _through_a_global(estimator):
  global _GLOBAL_ESTIMATOR
  _GLOBAL_ESTIMATOR = estimator

  def my_fn(features, labels, mode, config):
    return _GLOBAL_ESTIMATOR.model_fn(features, labels, mode, config)

  return my_fn


WRAPPERS = [_through_partial, _through_wrapped_attribute, _through_a_closure,
            _through_a_closure_of_a_closure, _through_a_global]


@pytest.fixture
def wrap_model_fn(request, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "_GLOBAL_ESTIMATOR", None)
  return request.param


@pytest.mark.parametrize("wrap_model_fn", WRAPPERS, indirect=True,
                         ids=lambda f: f.__name__[len("_through_"):])
def test_the_canned_checks_see_through_wrappers(wrap_model_fn, tmp_path):
  kmeans = tf.compat.v1.estimator.experimental.KMeans(
      2, model_dir=str(tmp_path / "kmeans"))
  with pytest.raises(ValueError, match="KMeansClustering is not trained by "
                     "gradients through an optimizer"):
    replicate.replicate_model_fn(wrap_model_fn(kmeans))
  # A compat.v1 head sums its loss: a stated MEAN would weight each
  # tower's loss by its share (a 3-tower step off by a factor of about 3).
  classifier = _make("DNNClassifier", "v1", str(tmp_path / "dnn"))
  with pytest.raises(ValueError, match="The DNNClassifier head reduces its "
                     "loss with 'weighted_sum'.*Pass loss_reduction=tf.compat"
                     ".v1.losses.Reduction.SUM."):
    replicate.replicate_model_fn(wrap_model_fn(classifier),
                                 loss_reduction=Reduction.MEAN)
  replicate.replicate_model_fn(wrap_model_fn(classifier),
                               loss_reduction=Reduction.SUM)


@pytest.mark.parametrize("family", ["v2", "v1"])
def test_dnn_batch_norm_statistics_move_once_with_the_batchs_mean(family,
                                                                  tmp_path):
  # The TF 2 canned DNN groups its Keras batch norm's updates with the
  # train_op, not through UPDATE_OPS (v1's layers use UPDATE_OPS). One step
  # from a shared checkpoint on 7 rows: the moving means are the unwrapped
  # ones, moved once with the whole batch's mean (4 + 3 or 3 + 2 + 2 rows).
  numeric, _, _ = _columns()
  module = tf.estimator if family == "v2" else tf.compat.v1.estimator
  optimizer = replicate.TowerOptimizer(
      (lambda: tf.keras.optimizers.legacy.SGD(0.1)) if family == "v2" else
      (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)))
  make = lambda model_dir: module.DNNClassifier(
      [4], numeric, n_classes=3, batch_norm=True, optimizer=optimizer,
      model_dir=model_dir)
  rows = lambda: tf.data.Dataset.from_tensor_slices(
      ({"x": X[:7]}, CLASS[:7])).batch(7)
  start = str(tmp_path / "start")
  make(start).train(rows, steps=1)
  results = {}
  for towers in (None, 2, 3):
    model_dir = str(tmp_path / str(towers))
    shutil.copytree(start, model_dir)
    canned = make(model_dir)
    if towers is None:
      canned.train(rows, steps=1)
    else:
      reduction = Reduction.SUM if family == "v1" else (
          Reduction.SUM_BY_NONZERO_WEIGHTS)
      tf.estimator.Estimator(
          replicate.replicate_model_fn(canned.model_fn,
                                       loss_reduction=reduction),
          model_dir=model_dir, config=tf.estimator.RunConfig(
              session_config=session_config(towers))).train(rows, steps=1)
    results[towers] = {
        name: tf.train.load_variable(model_dir, name)
        for name, _ in tf.train.list_variables(model_dir)
        if name.endswith("moving_mean")}
  assert results[None]  # the DNN has batch norm statistics
  for towers in (2, 3):
    assert sorted(results[towers]) == sorted(results[None])
    for name, value in results[None].items():
      np.testing.assert_allclose(results[towers][name], value, rtol=1e-5,
                                 atol=1e-7, err_msg=name)


# Pairwise over kind x variable_strategy x family x classes x batching x
# yield_single_examples x towers: any two factors meet in every pair of their
# values in some row (9 rows in place of 864).
STATIC_PREDICT = [
    ("DNNClassifier", "parameter_server", "v1", 2, "from_tensors", True, 2),
    ("DNNClassifier", "round_robin", "v1", 3, "from_tensors", False, 3),
    ("DNNClassifier", "replicated", "v2", 2, "drop_remainder", True, 3),
    ("LinearClassifier", "parameter_server", "v2", 3, "drop_remainder", False,
     3),
    ("LinearClassifier", "round_robin", "v1", 2, "drop_remainder", True, 3),
    ("LinearClassifier", "replicated", "v2", 3, "from_tensors", False, 2),
    ("DNNLinearCombinedClassifier", "parameter_server", "v1", 3,
     "from_tensors", True, 2),
    ("DNNLinearCombinedClassifier", "round_robin", "v2", 3, "drop_remainder",
     True, 2),
    ("DNNLinearCombinedClassifier", "replicated", "v1", 2, "from_tensors",
     False, 3),
]


def _static_predict_input(batching):
  """Batches whose size TensorFlow knows when it builds the graph."""
  rows = {"x": X, "color": COLOR}
  if batching == "from_tensors":
    return lambda: tf.data.Dataset.from_tensors(rows)  # one batch of 10
  return lambda: tf.data.Dataset.from_tensor_slices(rows).batch(
      4, drop_remainder=True)  # two batches of 4


def _static_predict_id(row):
  kind, strategy, family, n_classes, batching, is_single, towers = row
  return "-".join([kind, family, "binary" if n_classes == 2 else "3-class",
                   batching, "single" if is_single else "batched", strategy,
                   "{}-towers".format(towers)])


@pytest.mark.parametrize(
    "kind, strategy, family, n_classes, batching, is_single, towers",
    STATIC_PREDICT, ids=[_static_predict_id(row) for row in STATIC_PREDICT])
def test_predict_on_a_static_batch_gives_every_row_like_unwrapped(
    kind, strategy, family, n_classes, batching, is_single, towers,
    tmp_path):
  # With a static batch the heads' all_class_ids (and all_classes) depend on
  # the rows only through a shape folded to a constant: each tower's has its
  # own rows, so tower 0's alone would be short of rows.
  model_dir = str(tmp_path)
  _make(kind, family, model_dir, n_classes=n_classes).train(
      _train_input(kind, n_classes), steps=1)
  predict_input = _static_predict_input(batching)
  expected = list(_make(kind, family, model_dir, n_classes=n_classes).predict(
      predict_input, yield_single_examples=is_single))
  got = list(_wrapped(kind, family, model_dir, towers, strategy,
                      n_classes).predict(
                          predict_input, yield_single_examples=is_single))
  rows, batches = (ROWS, 1) if batching == "from_tensors" else (8, 2)
  assert len(got) == len(expected) == (rows if is_single else batches)
  for got_one, expected_one in zip(got, expected):
    assert sorted(got_one) == sorted(expected_one)
    assert "all_class_ids" in expected_one
    for key, value in expected_one.items():
      if value.dtype.kind == "f":
        np.testing.assert_allclose(got_one[key], value, rtol=1e-5, atol=1e-6,
                                   err_msg=key)
      else:
        np.testing.assert_array_equal(got_one[key], value, err_msg=key)
