"""replicate_model_fn: arguments, device choice, one device, serving, hygiene."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

import harness
import replicate
from replicate import _tf
from conftest import EVAL, PREDICT, TRAIN, cpus, regression_spec
from conftest import session_config

Reduction = tf.compat.v1.losses.Reduction


def _model_fn(features, labels, mode, params, config):
  del config
  scale = params.get("scale", 1.0) if params else 1.0
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  predictions = w * features * scale
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  return regression_spec(mode, labels, predictions,
                         tf.compat.v1.train.GradientDescentOptimizer(0.1))


def test_none_reduction_is_refused_when_wrapping():
  with pytest.raises(ValueError, match="none reduction is specified"):
    replicate.replicate_model_fn(_model_fn, loss_reduction=Reduction.NONE)


@pytest.mark.parametrize("kwargs, error, expected", [
    ({"loss_reduction": "average"}, ValueError,
     "loss_reduction must be one of"),
    ({"variable_strategy": "mirrored"}, ValueError,
     "'parameter_server', 'round_robin', 'replicated'. Received: 'mirrored'"),
    ({"variable_strategy": "replicated", "all_reduce": "tree"}, ValueError,
     "all_reduce must be one of 'auto', 'gather', 'ring', 'nccl'. Received: "
     "'tree'"),
    ({"all_reduce": "ring"}, ValueError,
     "apply only with variable_strategy='replicated' \\(received "
     "'parameter_server'\\)"),
    ({"variable_strategy": "round_robin", "compact_gradients": True},
     ValueError, "apply only with variable_strategy='replicated'"),
    ({"variable_strategy": "replicated", "compact_gradients": "yes"},
     ValueError, "compact_gradients must be True or False. Received: 'yes'"),
    ({"devices": ["/gpu:0", "/GPU:0"]}, ValueError, "twice"),
    ({"devices": []}, ValueError, "devices is empty"),
    ({"devices": ["/gpu:0", "gpu/0"]}, ValueError, "'gpu/0'"),
])
def test_bad_arguments_fail_when_wrapping(kwargs, error, expected):
  with pytest.raises(error, match=expected):
    replicate.replicate_model_fn(_model_fn, **kwargs)


def test_one_device_places_the_unchanged_model_fn_there(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=["/cpu:1"])(
      tf.ones([4]), tf.ones([4]), TRAIN)
  names = [op.name for op in graph.get_operations()]
  assert not [n for n in names if n.startswith("tower_")]
  assert not [n for n in names if "split" in n.lower()]  # no sharding
  assert spec.loss.device == "/device:CPU:1"
  w = tf.compat.v1.trainable_variables()[0]
  assert w.device == "/device:CPU:1"


def test_no_devices_means_every_cpu_the_session_config_gives(graph):
  config = tf.estimator.RunConfig(session_config=session_config(3))
  replicate.replicate_model_fn(_model_fn)(
      tf.ones([6]), tf.ones([6]), TRAIN, params={}, config=config)
  devices = {op.device for op in graph.get_operations() if op.device}
  assert {"/device:CPU:0", "/device:CPU:1", "/device:CPU:2"} <= devices
  assert graph.get_operation_by_name("tower_2/mean_squared_error/value")


def test_params_and_config_reach_the_model_fn_that_takes_them(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0]), None, PREDICT, params={"scale": 3.0},
      config=None)
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    np.testing.assert_allclose(session.run(spec.predictions), [3.0, 6.0])


def _features_only(features, mode):
  return tf.estimator.EstimatorSpec(mode, predictions=features)


def test_params_or_labels_the_model_fn_cannot_take_are_refused(graph):
  wrapped = replicate.replicate_model_fn(_features_only, devices=cpus(2))
  # The Estimator is shown params when the model_fn takes them, so it
  # refuses params for it as it does for the model_fn.
  assert "params" not in _tf.fn_args(wrapped)
  assert "params" in _tf.fn_args(replicate.replicate_model_fn(_model_fn))
  with pytest.raises(ValueError, match="does not include params argument"):
    tf.estimator.Estimator(wrapped, params={"scale": 2.0})
  # Called by hand, as the Estimator's signature allows.
  with pytest.raises(ValueError, match="does not take params"):
    wrapped(tf.ones([2]), None, PREDICT, params={"scale": 2.0})
  with pytest.raises(ValueError, match="does not take labels"):
    wrapped(tf.ones([2]), tf.ones([2]), PREDICT)
  spec = wrapped(tf.ones([2]), None, PREDICT, {}, None)
  assert spec.predictions.shape.as_list() == [2]


_Lines = harness.LogLines


def test_an_estimator_without_params_logs_no_params_warning():
  def with_params(features, mode, params):
    del params
    return _features_only(features, mode)

  with _Lines() as lines:
    tf.estimator.Estimator(
        replicate.replicate_model_fn(_features_only, devices=cpus(2)))
  assert not [line for line in lines if "params" in line]
  # The same capture sees the warning a model_fn naming params gets.
  with _Lines() as lines:
    tf.estimator.Estimator(
        replicate.replicate_model_fn(with_params, devices=cpus(2)))
  assert [line for line in lines if "includes params argument" in line]


def test_the_towers_built_are_logged_in_one_line(graph, monkeypatch):
  monkeypatch.setattr(replicate.call.devices, "local_devices",
                      lambda *args, **kwargs: cpus(3))
  with _Lines() as lines:
    replicate.replicate_model_fn(_model_fn, variable_strategy="round_robin")(
        tf.ones([6]), tf.ones([6]), TRAIN, params={})
  assert [line for line in lines if line.startswith("replicate:")] == [
      "replicate: 3 towers (train) on {}, variable_strategy='round_robin'."
      .format(", ".join(cpus(3)))]


@pytest.mark.parametrize("gpus, cores, hint", [
    (0, 4, "no GPU and 4 CPU cores, which TensorFlow counts as one device. "
           "For towers on CPU cores, give the Estimator tf.estimator.RunConfig"
           "(session_config=tf.compat.v1.ConfigProto(device_count={'CPU': 4}"
           "))."),
    (2, 4, "this machine has 2 GPUs but the session sees one"),
    (0, 1, None), (1, 8, None)])
def test_one_tower_where_the_machine_has_more_is_a_warning(
    monkeypatch, gpus, cores, hint):
  monkeypatch.setattr(tf.config, "list_physical_devices",
                      lambda kind=None: ["GPU:%d" % i for i in range(gpus)])
  monkeypatch.setattr(replicate.call.devices, "local_devices",
                      lambda *args, **kwargs: ["/device:CPU:0"])
  monkeypatch.setattr(replicate.towers.report.os, "cpu_count", lambda: cores)
  wrapped = replicate.replicate_model_fn(_model_fn)
  with _Lines() as lines:
    for mode in (TRAIN, EVAL):
      with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        wrapped(tf.ones([6]), tf.ones([6]), mode, params={},
                config=tf.estimator.RunConfig())
  warnings = [line for line in lines if line.startswith("replicate: 1 tower,")]
  if hint is None:
    assert warnings == []
  else:
    assert len(warnings) == 1 and hint in warnings[0], warnings
    assert warnings[0].endswith(
        "For one tower on purpose, pass devices=['/device:CPU:0'] to "
        "replicate_model_fn.")


def test_a_model_fn_that_returns_no_estimator_spec_is_named(graph):
  def model_fn(features, labels, mode):
    return features

  with pytest.raises(ValueError, match="tower 0 returned a SymbolicTensor"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([2]), None, PREDICT)


def test_serving_input_builds_one_tower_with_no_device_strings(graph):
  receiver = tf.compat.v1.placeholder(tf.float32, [None], name="input")
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(3))(
      receiver, None, PREDICT, params={})
  assert not [op.name for op in graph.get_operations() if op.device]
  assert not [op.name for op in graph.get_operations()
              if op.name.startswith("tower_")]
  # A default session (one CPU, no soft placement) serves a batch of 1.
  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    assert session.run(spec.predictions, {receiver: [5.0]}).tolist() == [5.0]


def test_prediction_input_from_a_dataset_is_still_split(graph):
  features = tf.compat.v1.data.make_one_shot_iterator(
      tf.data.Dataset.from_tensors(tf.constant([1.0, 2.0, 3.0]))).get_next()
  replicate.replicate_model_fn(_model_fn, devices=cpus(3))(
      features, None, PREDICT, params={})
  assert graph.get_operation_by_name("tower_2/mul")


@pytest.mark.parametrize("mode", [TRAIN, EVAL, PREDICT])
def test_nothing_of_the_wrapper_is_left_in_the_graph(mode):
  def build(model_fn):
    with tf.Graph().as_default() as g:
      tf.compat.v1.train.get_or_create_global_step()
      model_fn(tf.ones([5]), tf.ones([5]), mode, params={}, config=None)
      return g

  unwrapped = build(_model_fn)
  wrapped = build(replicate.replicate_model_fn(_model_fn, devices=cpus(3)))
  assert sorted(wrapped.get_all_collection_keys()) == sorted(
      unwrapped.get_all_collection_keys())
  for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
              tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
    assert [v.op.name for v in wrapped.get_collection(key)] == [
        v.op.name for v in unwrapped.get_collection(key)
    ]
  # Metric variables: one set per tower, nothing else of the wrapper's.
  local = [v.op.name for v in wrapped.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES)]
  assert len(local) == 3 * len(unwrapped.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES))


def test_default_scaffold_initialisation_is_all_training_needs(graph):
  spec = replicate.replicate_model_fn(_model_fn, devices=cpus(2))(
      tf.constant([1.0, 2.0]), tf.constant([3.0, 6.0]), TRAIN, params={})
  scaffold = tf.compat.v1.train.Scaffold()
  scaffold.finalize()
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(scaffold.init_op)
    session.run(scaffold.local_init_op)
    session.run(spec.train_op)
    # mse = mean((w x - y)^2); d/dw = mean(2 (w x - y) x) = (2*-2*1 +
    # 2*-4*2) / 2 = -10; w = 1 - 0.1 * -10 = 2.0
    w = tf.compat.v1.trainable_variables()[0]
    assert session.run(w) == pytest.approx(2.0)


# The Estimator calls a model_fn by keyword, so its parameters may come in any
# order; the wrapped model_fn must accept the same model_fns.

_X = np.arange(14, dtype=np.float32).reshape(7, 2) / 10.0
_Y = (_X[:, :1] * 2.0 - _X[:, 1:] + 0.5).astype(np.float32)


def _linear_spec(features, labels, mode, scale=1.0):
  """y = x w * scale, w starting at [[0.5], [-0.25]]; mean squared error."""
  w = tf.compat.v1.get_variable(
      "w", [2, 1], initializer=tf.compat.v1.constant_initializer([0.5, -0.25]))
  predictions = tf.matmul(features, w) * scale
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  return regression_spec(mode, labels, predictions,
                         tf.compat.v1.train.GradientDescentOptimizer(0.1))


def _mode_first(mode, features, labels):
  return _linear_spec(features, labels, mode)


def _labels_first(labels, features, mode, params):
  return _linear_spec(features, labels, mode, params["scale"])


def _as_estimator_calls(model_fn, features, labels, mode, params):
  """Calls `model_fn` by keyword with what it takes, as the Estimator does."""
  kwargs = {"features": features, "labels": labels, "mode": mode,
            "params": params, "config": None}
  taken = inspect.signature(model_fn).parameters
  return model_fn(**{k: v for k, v in kwargs.items() if k in taken})


def _outcome_by_mode(model_fn, params):
  """TRAIN: loss and w after one step; EVAL: loss, mae; PREDICT; serving."""
  outcome = {}
  for mode in (TRAIN, EVAL, PREDICT, "serving"):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      features = tf.constant(_X)
      if mode == "serving":  # as export_saved_model builds it
        features = tf.compat.v1.placeholder(tf.float32, [None, 2])
      spec = _as_estimator_calls(
          model_fn, features, None if mode in (PREDICT, "serving") else
          tf.constant(_Y), PREDICT if mode == "serving" else mode, params)
      with tf.compat.v1.Session(config=session_config(3)) as session:
        session.run([tf.compat.v1.global_variables_initializer(),
                     tf.compat.v1.local_variables_initializer()])
        if mode == TRAIN:
          loss, _ = session.run([spec.loss, spec.train_op])
          outcome[mode] = (loss, session.run(tf.compat.v1.trainable_variables(
          )[0]))
        elif mode == EVAL:
          session.run(spec.eval_metric_ops["mae"][1])
          outcome[mode] = session.run(
              (spec.loss, spec.eval_metric_ops["mae"][0]))
        else:
          outcome[mode] = session.run(spec.predictions,
                                      {features: _X} if mode == "serving"
                                      else None)
  return outcome


@pytest.mark.parametrize("model_fn", [_mode_first, _labels_first],
                         ids=["mode-features-labels",
                              "labels-features-mode-params"])
@pytest.mark.parametrize("towers", [1, 2, 3])
def test_model_fn_parameters_in_any_order(model_fn, towers):
  params = {"scale": 1.5} if model_fn is _labels_first else None
  expected = _outcome_by_mode(model_fn, params)
  got = _outcome_by_mode(
      replicate.replicate_model_fn(model_fn, devices=cpus(towers)), params)
  for mode in expected:
    for got_value, expected_value in zip(tf.nest.flatten(got[mode]),
                                         tf.nest.flatten(expected[mode])):
      np.testing.assert_allclose(got_value, expected_value, rtol=1e-5,
                                 err_msg=mode)
  # One step on 7 rows moved w: the towers' update is the whole batch's.
  assert not np.allclose(expected[TRAIN][1], [[0.5], [-0.25]])


def test_a_model_fn_without_a_features_argument_is_refused_when_wrapping():
  def model_fn(inputs, labels, mode):
    return _linear_spec(inputs, labels, mode)

  with pytest.raises(ValueError, match="takes no argument named features "
                     r"\(it takes inputs, labels, mode\).*Name the model_fn's "
                     "first argument features"):
    replicate.replicate_model_fn(model_fn)


def test_estimator_runs_a_labels_first_model_fn_wrapped_like_unwrapped(
    tmp_path):
  def input_fn():
    return tf.data.Dataset.from_tensors((_X, _Y)).repeat(2)

  def serving_input_fn():
    rows = tf.compat.v1.placeholder(tf.float32, [None, 2])
    return tf.estimator.export.TensorServingInputReceiver(rows, {"input": rows})

  def run(model_fn, name):
    estimator = tf.estimator.Estimator(
        model_fn, model_dir=str(tmp_path / name), params={"scale": 1.5},
        config=tf.estimator.RunConfig(session_config=session_config(3)))
    estimator.train(input_fn)
    metrics = estimator.evaluate(input_fn, steps=1)
    predictions = np.array(list(estimator.predict(
        lambda: tf.data.Dataset.from_tensors(_X))))
    export_dir = estimator.export_saved_model(
        str(tmp_path / name / "export"), serving_input_fn).decode()
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
      signature = tf.compat.v1.saved_model.load(
          session, ["serve"], export_dir).signature_def["serving_default"]
      served = session.run(
          signature.outputs["output"].name,
          {signature.inputs["input"].name: _X[:3]})
    return metrics, predictions, served

  expected = run(_labels_first, "unwrapped")
  got = run(replicate.replicate_model_fn(_labels_first, devices=cpus(3)),
            "wrapped")
  assert got[0]["global_step"] == expected[0]["global_step"] == 2
  for key in ("loss", "mae"):
    np.testing.assert_allclose(got[0][key], expected[0][key], rtol=1e-5)
  np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)
  np.testing.assert_allclose(got[2], expected[1][:3], rtol=1e-5)


def _two_features_model_fn(features, mode):
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  return tf.estimator.EstimatorSpec(mode, predictions={
      "x": w * features["x"], "other": features["other"] * 2.0})


def test_prediction_with_features_of_different_lengths():
  # What PREDICT does when features' dimension 0 disagree (docs/guarantees.md, errors).
  def predict(make_features, feed, towers=2):
    with tf.Graph().as_default():
      features = make_features()
      spec = replicate.replicate_model_fn(
          _two_features_model_fn, devices=cpus(towers))(
              features, None, PREDICT)
      with tf.compat.v1.Session(config=session_config(towers)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(spec.predictions, feed(features))

  x, other = np.arange(4, dtype=np.float32), np.arange(3, dtype=np.float32)
  # A serving graph (placeholders, as export builds) is one unsplit tower:
  # each output comes back on its own, as unwrapped.
  served = predict(
      lambda: {name: tf.compat.v1.placeholder(tf.float32, [None])
               for name in ("x", "other")},
      lambda features: {features["x"]: x, features["other"]: other})
  np.testing.assert_array_equal(served["x"], x)
  np.testing.assert_array_equal(served["other"], other * 2.0)

  # From an input pipeline each feature is split by its own rows, and each
  # output put back with the rows of the feature it comes from: 4 rows on 3
  # towers (2 + 1 + 1) and 3 rows (1 + 1 + 1).
  def pipeline():
    dataset = tf.data.Dataset.from_generator(
        lambda: iter([{"x": x, "other": other}]), output_signature={
            name: tf.TensorSpec([None], tf.float32) for name in ("x", "other")})
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()

  split = predict(pipeline, lambda features: None, towers=3)
  np.testing.assert_array_equal(split["x"], x)
  np.testing.assert_array_equal(split["other"], other * 2.0)
