"""Per-step time of gradients the model_fn touches, on 2 towers of an MLP.

Not a test: `python -m benchmarks.touched_gradients_timing` prints the
time of a training step (`session.run(train_op)`) for a 3-layer MLP
(784-256-256-10, batch 256) on 2 virtual CPU towers, with `minimize`, with
`tf.clip_by_global_norm` after `compute_gradients`, and after
`tf.gradients` (BERT's way), each for "parameter_server" and "replicated":
the 10th percentile of the step times (the machine may be shared), and the
number of ops in the graph.
Run it with the tree to measure first on the path.
"""

import argparse
import sys
import time

WAYS = ("minimize", "compute_gradients", "tf.gradients")


def make_parser():
  """The command line: which ways to time (all by default)."""
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.touched_gradients_timing",
      description=__doc__.splitlines()[0])
  parser.add_argument("ways", nargs="*", metavar="WAY", choices=WAYS,
                      help="of {} (default: all)".format(", ".join(WAYS)))
  return parser


if __name__ == "__main__":
  # --help and a bad way answer before TensorFlow's import, which takes
  # seconds; main() parses the command line again.
  make_parser().parse_args()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402

STEPS, WARMUP, BATCH = 150, 20, 256


def _model_fn(way):

  def model_fn(features, labels, mode):
    x = features["x"]
    variables = []
    for index, (rows, cols) in enumerate([(784, 256), (256, 256), (256, 10)]):
      variables.append(tf.compat.v1.get_variable(
          "w{}".format(index), [rows, cols],
          initializer=tf.compat.v1.glorot_uniform_initializer(seed=index)))
      x = tf.matmul(x, variables[-1])
      if index < 2:
        x = tf.nn.relu(x)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, x)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.01))
    step = tf.compat.v1.train.get_global_step()
    if way == "minimize":
      train_op = optimizer.minimize(loss, step)
    else:
      if way == "compute_gradients":
        grads, variables = zip(*optimizer.compute_gradients(loss, variables))
      else:
        grads = tf.gradients(loss, variables)
      grads, _ = tf.clip_by_global_norm(grads, 1.0)
      train_op = optimizer.apply_gradients(zip(grads, variables), step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def step_time(way, strategy):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(BATCH, 784).astype(np.float32))
    y = tf.constant(rng.randint(0, 10, BATCH).astype(np.int32))
    spec = replicate.replicate_model_fn(
        _model_fn(way), devices=["/cpu:0", "/cpu:1"],
        variable_strategy=strategy)({"x": x}, y, tf.estimator.ModeKeys.TRAIN)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2},
                                      allow_soft_placement=True)
    graph_ops = len(tf.compat.v1.get_default_graph().get_operations())
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())  # copies
      times = []
      for index in range(STEPS + WARMUP):
        start = time.perf_counter()
        session.run(spec.train_op)
        if index >= WARMUP:
          times.append(time.perf_counter() - start)
  # The machine is shared: the fastest steps are the ones not interrupted.
  return float(np.percentile(times, 10)), graph_ops


def main(argv=None):
  ways = make_parser().parse_args(argv).ways or list(WAYS)
  print("replicate from", replicate.__file__)
  for strategy in ("parameter_server", "replicated"):
    for way in ways:
      seconds, graph_ops = step_time(way, strategy)
      print("{:17s} {:18s} {:.2f} ms  ({} ops in the graph)".format(
          strategy, way, 1000 * seconds, graph_ops))
      sys.stdout.flush()


if __name__ == "__main__":
  main()
