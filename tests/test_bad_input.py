"""Bad input fails early with the error type and a message that says the fix.

One table: each row builds something wrong and names the exact exception
and the words of its message. Inputs that are unusual but fine (nested
dicts, labels None in TRAIN, an optimizer reused across graphs) are tested
to work below the table.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction


def _model_fn(features, labels, mode):
  x = features["x"] if isinstance(features, dict) else features
  w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
  predictions = w * tf.cast(x, tf.float32)
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"y": predictions})
  loss = tf.reduce_mean(predictions)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _wrap(**kwargs):
  return replicate.replicate_model_fn(_model_fn, **kwargs)


def _call(features, labels=None, mode=TRAIN, **kwargs):
  """Builds the wrapped model_fn on 2 towers in a fresh graph."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    return _wrap(devices=cpus(2), **kwargs)(features(), labels, mode)


def _run_mismatched_batch():
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    a = tf.compat.v1.placeholder(tf.float32, [None])
    b = tf.compat.v1.placeholder(tf.float32, [None])
    # (PREDICT on placeholders would be a serving graph, built unsplit.)
    spec = _wrap(devices=cpus(2))({"x": a, "other": b}, None, EVAL)
    with tf.compat.v1.Session(config=session_config(2)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(spec.loss, {a: np.ones(4), b: np.ones(3)})


def _towers_returning_different_structures():
  built = []

  def model_fn(features, labels, mode):
    built.append(1)
    keys = ["y"] if len(built) == 1 else ["y", "extra"]
    return tf.estimator.EstimatorSpec(
        mode, predictions={key: features * 1.0 for key in keys})

  with tf.Graph().as_default():
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([4]), None, PREDICT)


def _vector_loss():
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [])
    return tf.estimator.EstimatorSpec(mode, loss=w * features,
                                      train_op=tf.no_op())

  with tf.Graph().as_default():
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([4]), None, TRAIN)


def _device_the_session_lacks():
  config = tf.estimator.RunConfig(session_config=session_config(2))
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    _wrap(devices=["/cpu:0", "/gpu:3"])(tf.ones([4]), None, TRAIN,
                                         config=config)


def _device_of_another_job():
  config = tf.estimator.RunConfig(session_config=session_config(2))
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    _wrap(devices=["/job:foo/cpu:0", "/job:foo/cpu:1"])(
        tf.ones([4]), None, TRAIN, config=config)


BAD_INPUTS = {
    "scalar feature": (
        lambda: _call(lambda: {"x": tf.constant(3.0)}), ValueError,
        r"features\['x'\] is a scalar .* needs shape \[batch, \.\.\.\]"),
    "features' dimension 0 disagree (static)": (
        lambda: _call(lambda: {"x": tf.ones([4]), "other": tf.ones([5])}),
        ValueError, r"features\['other'\] has 5 rows and features\['x'\] "
        r"has 4\. Give every feature and label the same batch size"),
    "features and labels disagree (static)": (
        lambda: _call(lambda: {"x": tf.ones([4])}, labels=tf.ones([3])),
        ValueError, r"features\['x'\] has 4 rows and labels has 3"),
    "dimension 0 disagree (run time)": (
        _run_mismatched_batch, tf.errors.InvalidArgumentError,
        # (TensorFlow escapes the quotes of the names in the message.)
        r"features\[\W*x\W*\] and features\[\W*other\W*\] must share "
        r"dimension 0 \(the batch\)"),
    "RaggedTensor feature": (
        lambda: _call(lambda: {"x": tf.ragged.constant([[1.0], [2.0, 3.0]])}),
        ValueError, r"is a RaggedTensor.*\.to_sparse\(\) or \.to_tensor\(\)"),
    "a string where a tensor goes": (
        lambda: _call(lambda: {"x": tf.ones([2]), "name": "abc"}), ValueError,
        r"features\['name'\] is a str; replicate_model_fn splits Tensors"),
    "no tensor at all": (
        lambda: _call(lambda: {}), ValueError, "hold no tensor to split"),
    "malformed device": (
        lambda: _wrap(devices=["/gpu:0", "gpu-1"]), ValueError,
        r"contains 'gpu-1', which TensorFlow cannot parse as a device"),
    "duplicated device": (
        lambda: _wrap(devices=["/gpu:0", "/device:GPU:0"]), ValueError,
        r"contains '/device:GPU:0' twice; each device may appear once\. "
        r"Received: \['/gpu:0', '/device:GPU:0'\]"),
    "empty devices": (
        lambda: _wrap(devices=[]), ValueError,
        r"devices is empty; give at least one device"),
    "device the session does not have": (
        _device_the_session_lacks, ValueError,
        r"contains '/device:GPU:3', which the Estimator's session does not "
        r"have \(it has /device:CPU:0, /device:CPU:1\)"),
    "a device of a job the local session lacks": (
        _device_of_another_job, ValueError, r"contains '/job:foo/device:CPU:0', which names job "
        r"'foo'; but this RunConfig has no cluster"),
    "a wildcard device": (
        lambda: _wrap(devices=["/cpu:*"]), ValueError,
        r"contains '/cpu:\*', a wildcard; .* list each device"),
    "unknown variable strategy": (
        lambda: _wrap(variable_strategy="mirrored"), ValueError,
        r"variable_strategy must be one of 'parameter_server', "
        r"'round_robin', 'replicated'"),
    "none reduction": (
        lambda: _wrap(loss_reduction=Reduction.NONE), ValueError,
        "none reduction is specified"),
    "towers returning different structures": (
        _towers_returning_different_structures, ValueError,
        r"Tower 1's EstimatorSpec differs from tower 0's in its predictions: "
        r"\['extra', 'y'\] instead of \['y'\]"),
    "loss that is not a scalar": (
        _vector_loss, ValueError, "Loss must be scalar"),
    "not an optimizer": (
        lambda: replicate.TowerOptimizer("adam"), ValueError,
        r"TowerOptimizer wraps a tf\.compat\.v1\.train\.Optimizer, a "
        r"tf\.keras\.optimizers\.legacy\.Optimizer, or a function"),
    # Issue 29: the natural next try must be named in the refusal.
    "a Keras optimizer of TF 2.11+": (
        lambda: replicate.TowerOptimizer(tf.keras.optimizers.Adam()),
        ValueError,
        r"cannot run in an Estimator's graph.*tf\.compat\.v1\.train\."
        r"AdamOptimizer.*optimizer\.get_updates\(loss, params\)\[0\]"),
    "a function returning a Keras optimizer of TF 2.11+": (
        lambda: replicate.TowerOptimizer(tf.keras.optimizers.Adam),
        ValueError, r"must return a tf\.compat\.v1.*cannot run in an "
        r"Estimator's graph"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_clearly(case):
  build, error, message = BAD_INPUTS[case]
  with pytest.raises(error, match=message):
    build()


def test_nested_dict_features_are_split_and_put_back(graph):
  def model_fn(features, labels, mode):
    return tf.estimator.EstimatorSpec(mode, predictions={
        "sum": features["a"]["b"] + tf.reduce_sum(features["a"]["c"], 1)})

  b = np.arange(5.0)
  c = np.arange(10.0).reshape(5, 2)
  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      {"a": {"b": b, "c": c}}, None, PREDICT)
  with tf.compat.v1.Session(config=session_config(3)) as session:
    # sum = b + c[:, 0] + c[:, 1] = [0+0+1, 1+2+3, 2+4+5, 3+6+7, 4+8+9]
    assert session.run(spec.predictions)["sum"].tolist() == [1, 6, 11, 16, 21]


def test_labels_none_in_train_trains_an_unsupervised_model(graph):
  # mean(w * x) with x = [1, 2, 3]: w = 1 - 0.1 * 2 = 0.8, on 2 towers.
  spec = _wrap(devices=cpus(2))({"x": tf.constant([1.0, 2.0, 3.0])}, None,
                                TRAIN)
  w = tf.compat.v1.trainable_variables()[0]
  with tf.control_dependencies([spec.train_op]):
    w_after = tf.identity(w.read_value())
  with tf.compat.v1.Session(config=session_config(2)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    assert session.run(w_after) == pytest.approx(0.8)


def test_a_keras_optimizer_instance_serves_every_graph(tmp_path):
  # Unwrapped, TensorFlow refuses the second train() call ("Cannot set
  # `iterations` to a new Variable"); wrapped, each graph gets a copy.
  canned = tf.estimator.DNNClassifier(
      [4], [tf.feature_column.numeric_column("x", shape=[3])],
      optimizer=replicate.TowerOptimizer(
          tf.keras.optimizers.legacy.Adagrad(0.1)), model_dir=str(tmp_path))
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(canned.model_fn), model_dir=str(tmp_path),
      config=tf.estimator.RunConfig(session_config=session_config(2)))
  x = np.random.RandomState(0).rand(8, 3).astype(np.float32)
  input_fn = lambda: tf.data.Dataset.from_tensors(  # noqa: E731
      ({"x": x}, np.arange(8) % 2)).repeat(2)
  estimator.train(input_fn)
  estimator.train(input_fn)
  assert estimator.get_variable_value("global_step") == 4
