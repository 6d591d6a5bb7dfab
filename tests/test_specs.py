"""Combining tower specs: loss, eval metrics, predictions, export outputs."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from conftest import EVAL, PREDICT, TRAIN, cpus, session_config

Reduction = tf.compat.v1.losses.Reduction


def _metrics_model_fn(features, labels, mode):
  predictions = tf.cast(features > 0.5, tf.int64)
  loss = tf.reduce_mean(tf.cast(features, tf.float32)) * 0.0
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, eval_metric_ops={
          "accuracy": tf.compat.v1.metrics.accuracy(labels, predictions),
          "mean": tf.compat.v1.metrics.mean(features),
          "keras_mean": _keras_mean(features),
      })


def _keras_mean(values):
  metric = tf.keras.metrics.Mean(name="keras_mean")
  metric.update_state(values)
  return metric


def test_metrics_report_the_whole_batch_without_side_effects_on_read(graph):
  x = tf.compat.v1.placeholder(tf.float32, [None])
  y = tf.compat.v1.placeholder(tf.int64, [None])
  spec = replicate.replicate_model_fn(_metrics_model_fn, devices=cpus(3))(
      x, y, EVAL)
  values = {k: v for k, (v, _) in spec.eval_metric_ops.items()}
  updates = {k: u for k, (_, u) in spec.eval_metric_ops.items()}
  first_x = np.array([0.9, 0.1, 0.7, 0.2, 0.8, 0.6, 0.3])  # 7 rows: 3, 2, 2
  first_y = np.array([1, 0, 0, 0, 1, 1, 1])
  with tf.compat.v1.Session(config=session_config(3)) as session:
    session.run(tf.compat.v1.local_variables_initializer())
    session.run(updates, {x: first_x, y: first_y})
    first = session.run(values)
    assert session.run(values) == first  # reading twice changes nothing
    # accuracy: predictions 1,0,1,0,1,1,0 vs labels -> 5 of 7 right.
    assert first["accuracy"] == pytest.approx(5 / 7)
    assert first["mean"] == pytest.approx(3.6 / 7)
    assert first["keras_mean"] == pytest.approx(3.6 / 7)
    # A second batch of 2 rows (towers 1, 1, 0) accumulates with the first.
    session.run(updates, {x: [1.0, 0.0], y: [0, 0]})
    second = session.run(values)
  assert second["accuracy"] == pytest.approx(6 / 9)
  assert second["mean"] == pytest.approx(4.6 / 9)
  assert second["keras_mean"] == pytest.approx(4.6 / 9)


def _keras_metrics_model_fn(features, labels, mode):
  metrics = {}
  for metric in (tf.keras.metrics.AUC(name="auc"),
                 tf.keras.metrics.Precision(name="precision"),
                 tf.keras.metrics.Recall(name="recall"),
                 tf.keras.metrics.Accuracy(name="accuracy")):
    metric.update_state(
        labels, tf.cast(features > 0.5, tf.int64)
        if metric.name == "accuracy" else features)
    metrics[metric.name] = metric
  return tf.estimator.EstimatorSpec(mode, loss=tf.reduce_mean(features),
                                    eval_metric_ops=metrics)


@pytest.mark.parametrize("towers", [2, 3])
def test_keras_metric_objects_report_the_whole_batch(towers):
  # 7 rows: uneven over 2 and 3 towers; the references are the same Keras
  # metrics computed on the whole batch in one graph.
  scores = np.array([0.9, 0.2, 0.7, 0.4, 0.8, 0.6, 0.1], np.float32)
  labels = np.array([1, 0, 0, 0, 1, 1, 1], np.int64)
  results = []
  for model_fn, count in ((_keras_metrics_model_fn, 1),
                          (replicate.replicate_model_fn(
                              _keras_metrics_model_fn, devices=cpus(towers)),
                           towers)):
    with tf.Graph().as_default():
      spec = model_fn(tf.constant(scores), tf.constant(labels), EVAL)
      with tf.compat.v1.Session(config=session_config(count)) as session:
        session.run(tf.compat.v1.local_variables_initializer())
        session.run([u for _, u in spec.eval_metric_ops.values()])
        results.append(session.run(
            {k: v for k, (v, _) in spec.eval_metric_ops.items()}))
  single, replicated = results
  # precision: predicted 1 at >0.5 = rows 0, 2, 4, 5; right: 0, 4, 5 -> 3/4.
  assert single["precision"] == pytest.approx(0.75)
  assert single["recall"] == pytest.approx(0.75)  # 3 of the 4 positives
  for key, value in single.items():
    assert replicated[key] == pytest.approx(value, rel=1e-6), key


def test_metrics_named_differently_per_tower_pair_by_creation_order(graph):
  towers_built = []

  def model_fn(features, labels, mode):
    towers_built.append(1)
    name = "acc_{}".format(len(towers_built))  # a new name in every tower
    return tf.estimator.EstimatorSpec(
        mode, loss=tf.constant(0.0), eval_metric_ops={
            "accuracy": tf.compat.v1.metrics.accuracy(
                labels, tf.cast(features > 0.5, tf.int64), name=name)
        })

  features = tf.constant([0.9, 0.1, 0.7, 0.2, 0.8])
  labels = tf.constant([1, 1, 1, 0, 0], tf.int64)
  spec = replicate.replicate_model_fn(model_fn, devices=cpus(2))(
      features, labels, EVAL)
  with tf.compat.v1.Session(config=session_config()) as session:
    session.run(tf.compat.v1.local_variables_initializer())
    session.run(spec.eval_metric_ops["accuracy"][1])
    accuracy = session.run(spec.eval_metric_ops["accuracy"][0])
  # Right on rows 0, 2, 3 of 5, 3 rows in tower 0 ('acc_1'), 2 in tower 1
  # ('acc_2'): 3/5 = 0.6 only if tower 1's total and count are folded.
  assert accuracy == pytest.approx(0.6)


def _predict_model_fn(features, labels, mode):
  del labels
  scores = tf.stack([features, -features], axis=1)
  classes = tf.as_string(tf.cast(features, tf.int64))[:, None]
  return tf.estimator.EstimatorSpec(
      mode, predictions={"double": features * 2, "scores": scores},
      export_outputs={
          "serving_default": tf.estimator.export.PredictOutput({"double":
                                                        features * 2}),
          "regress": tf.estimator.export.RegressionOutput(features[:, None]),
          "classify": tf.estimator.export.ClassificationOutput(
              scores=scores, classes=classes),
      })


def test_predictions_and_export_outputs_line_up_with_input_rows(graph):
  rows = np.arange(7, dtype=np.float32)
  spec = replicate.replicate_model_fn(_predict_model_fn, devices=cpus(3))(
      tf.constant(rows), None, PREDICT)
  outputs = spec.export_outputs
  assert isinstance(outputs["classify"],
                    tf.estimator.export.ClassificationOutput)
  with tf.compat.v1.Session(config=session_config(3)) as session:
    predictions, double, value, scores, classes = session.run([
        spec.predictions, outputs["serving_default"].outputs["double"],
        outputs["regress"].value, outputs["classify"].scores,
        outputs["classify"].classes
    ])
  np.testing.assert_array_equal(predictions["double"], rows * 2)
  np.testing.assert_array_equal(predictions["scores"][:, 1], -rows)
  np.testing.assert_array_equal(double, rows * 2)
  np.testing.assert_array_equal(value[:, 0], rows)
  np.testing.assert_array_equal(scores[:, 0], rows)
  assert [c[0] for c in classes] == [b"0", b"1", b"2", b"3", b"4", b"5", b"6"]


def test_scalar_predictions_cannot_be_put_back_together(graph):
  def model_fn(features, labels, mode):
    # Not a reduction (whose value over the whole batch replicate gives).
    return tf.estimator.EstimatorSpec(
        mode, predictions={"total": tf.norm(features)})

  with pytest.raises(ValueError, match=r"predictions\[.total.\] is computed "
                     r"from each tower.s rows but is a scalar"):
    replicate.replicate_model_fn(model_fn, devices=cpus(2))(
        tf.ones([4]), None, PREDICT)


def test_loss_of_a_batch_smaller_than_the_towers_is_finite(graph):
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
    loss = tf.reduce_mean(w * features)  # NaN on an empty tower
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0)).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  x = tf.compat.v1.placeholder(tf.float32, [None])
  spec = replicate.replicate_model_fn(model_fn, devices=cpus(3))(
      x, None, TRAIN)
  w = tf.compat.v1.trainable_variables()[0]
  with tf.compat.v1.Session(config=session_config(3)) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    loss, _ = session.run([spec.loss, spec.train_op], {x: [2.0, 4.0]})
    # Towers get 1, 1 and 0 rows: loss = 0.5 * 2 + 0.5 * 4 + 0 = 3.0 (w=1),
    # and w = 1 - 1.0 * mean(x) = -2.0 with no NaN from the empty tower.
    assert loss == pytest.approx(3.0)
    assert session.run(w) == pytest.approx(-2.0)
