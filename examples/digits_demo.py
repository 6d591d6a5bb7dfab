"""Train a DNN classifier on every local device with one changed line.

The data is scikit-learn's bundled 8x8 digits (1,797 images, no download).
The model_fn is ordinary Estimator code; the one change is
`replicate.replicate_model_fn(model_fn)` (and the optimizer wrapped in
`replicate.TowerOptimizer`). With GPUs it uses every GPU; without, it makes
`--towers` virtual CPU devices, which is how it runs on a laptop or in CI.

    python examples/digits_demo.py --towers 2
"""

import os
import tempfile
import time
import warnings

import demo_flags


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  return demo_flags.digits_parser(__doc__.splitlines()[0])


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which takes
  # seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import replicate  # noqa: E402

CLASSES = 10


def model_fn(features, labels, mode, params):
  """A plain Estimator model_fn: two hidden layers, softmax over 10 digits."""
  hidden = features["pixels"]
  for index, units in enumerate(params["hidden_units"]):
    hidden = tf.compat.v1.layers.dense(hidden, units, tf.nn.relu,
                                       name="hidden_{}".format(index))
  logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits")
  predicted = tf.argmax(logits, axis=1)
  if mode == tf.estimator.ModeKeys.PREDICT:
    predictions = {"class": predicted, "probabilities": tf.nn.softmax(logits)}
    return tf.estimator.EstimatorSpec(
        mode, predictions=predictions,
        export_outputs={"serving_default":
                        tf.estimator.export.PredictOutput(predictions)})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(  # the optimizer, wrapped
      tf.compat.v1.train.AdamOptimizer(params["learning_rate"]))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  accuracy = tf.compat.v1.metrics.accuracy(labels, predicted)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    eval_metric_ops={"accuracy": accuracy})


class ExamplesPerSecondHook(tf.estimator.SessionRunHook):
  """Logs training speed every `every_steps` steps and keeps the average."""

  def __init__(self, batch_size, every_steps):
    self._batch_size = batch_size
    self._every_steps = every_steps
    self._steps = 0
    self._started = None
    self._window_started = None
    self.examples_per_second = float("nan")

  def after_run(self, run_context, run_values):
    del run_context, run_values
    now = time.perf_counter()
    if self._started is None:  # the first step builds and warms up
      self._started = self._window_started = now
      return
    self._steps += 1
    if self._steps % self._every_steps == 0:
      window = self._every_steps * self._batch_size / (
          now - self._window_started)
      print("  step {:>5}: {:>9,.0f} examples/sec".format(
          self._steps + 1, window), flush=True)
      self._window_started = now
    self.examples_per_second = self._steps * self._batch_size / (
        now - self._started)


def main():
  args = _parse_args()
  # Keras-backed tf.compat.v1.layers draw their initializers' seeds from
  # Python's and NumPy's generators, which RunConfig(tf_random_seed) does not
  # reach; seeding them too makes every run of the demo give the same numbers.
  tf.keras.utils.set_random_seed(0)
  x_train, x_test, y_train, y_test = _digits()
  gpus = tf.config.list_physical_devices("GPU")
  session_config = None if gpus else tf.compat.v1.ConfigProto(
      device_count={"CPU": args.towers})
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir, session_config=session_config,
      tf_random_seed=0, log_step_count_steps=None, save_summary_steps=None)
  estimator = tf.estimator.Estimator(
      model_fn=replicate.replicate_model_fn(model_fn),  # the one-line change
      config=config,
      params={"hidden_units": [128, 64], "learning_rate": 0.002})
  towers = ["/device:GPU:{}".format(i) for i in range(len(gpus))] or [
      "/device:CPU:{}".format(i) for i in range(args.towers)]
  print("Training on {} towers: {}".format(len(towers), ", ".join(towers)))

  speed = ExamplesPerSecondHook(args.batch_size, every_steps=100)
  estimator.train(
      lambda: _dataset(x_train, y_train, args.batch_size, shuffle=True),
      steps=args.steps, hooks=[speed])
  metrics = estimator.evaluate(
      lambda: _dataset(x_test, y_test, args.batch_size))
  predictions = list(estimator.predict(
      lambda: _dataset(x_test[:8], None, args.batch_size)))
  export_dir = estimator.export_saved_model(
      os.path.join(estimator.model_dir, "export"),
      tf.estimator.export.build_raw_serving_input_receiver_fn(
          {"pixels": tf.zeros([1, x_train.shape[1]])})).decode()

  print("\nSummary")
  print("  test accuracy      {:.4f} on {} held-out digits".format(
      metrics["accuracy"], len(y_test)))
  print("  test loss          {:.4f}".format(metrics["loss"]))
  print("  predicted classes  {} (true {})".format(
      [int(p["class"]) for p in predictions], y_test[:8].tolist()))
  print("  training speed     {:,.0f} examples/sec (batch {}, {} steps)".format(
      speed.examples_per_second, args.batch_size, args.steps))
  print("  towers             {}".format(", ".join(towers)))
  print("  model_dir          {}".format(estimator.model_dir))
  print("  SavedModel         {}".format(export_dir))


def _parse_args(argv=None):
  args = make_parser().parse_args(argv)
  if args.model_dir is None:  # the summary names it; nothing in the checkout
    args.model_dir = tempfile.mkdtemp(prefix="replicate_digits_")
  return args


def _digits():
  """Standardised 8x8 digits, 80% for training, 20% held out (fixed seed)."""
  digits = load_digits()
  pixels = (digits.data / 16.0).astype(np.float32)
  order = np.random.RandomState(0).permutation(len(pixels))
  split = int(0.8 * len(pixels))
  train, test = order[:split], order[split:]
  mean, std = pixels[train].mean(axis=0), pixels[train].std(axis=0) + 1e-6
  pixels = (pixels - mean) / std
  return (pixels[train], pixels[test], digits.target[train].astype(np.int64),
          digits.target[test].astype(np.int64))


def _dataset(pixels, labels, batch_size, shuffle=False):
  features = {"pixels": pixels}
  dataset = tf.data.Dataset.from_tensor_slices(
      features if labels is None else (features, labels))
  if shuffle:
    dataset = dataset.shuffle(len(pixels), seed=0).repeat()
  return dataset.batch(batch_size)


def quiet_tensorflow():
  """Only TensorFlow's errors, so the demo's own lines can be read.

  TensorFlow 2.15 marks the whole Estimator stack deprecated: without this,
  each first use of a class prints a three-line notice through TensorFlow's
  logger (over a hundred lines in the cluster demo), `tf.compat.v1.layers`
  a UserWarning, and a cluster's chief a warning whenever the global step
  seems not to move (another worker's step may not be visible yet). C++
  lines are `TF_CPP_MIN_LOG_LEVEL`'s, set before TensorFlow is imported.
  """
  tf.get_logger().setLevel("ERROR")
  warnings.filterwarnings("ignore", message=r".*tf\.layers\..* is deprecated")


if __name__ == "__main__":
  quiet_tensorflow()
  main()
