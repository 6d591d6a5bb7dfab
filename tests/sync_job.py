"""The job every task of the synchronous multi-worker tests runs.

  python tests/sync_job.py MODEL_DIR MAX_STEPS BATCHES [--hidden H[,H...]]
      [--towers N[,N...]] [--batch-norm {fused,plain}] [--embedding]
      [--weight-decay] [--static] [--sparse-optimizers] [--negatives]
      [--clip {compute,gradients}]

`BATCHES` gives, per task in rank order (chief, worker 0, 1, ...), the rows
of each of its batches: `"6,5,0;5,4,3"` is a chief with batches of 6, 5
and 0 rows and a worker with 5, 4 and 3; `"4*100"` is 100 batches of 4. A
task's input ends after its last batch. Every batch's rows come from
`batch(rank, step, rows)`, so the test builds the one-device reference on
the same data; a job restarted from a checkpoint of global step s starts
at batch s.

The model (`model_fn`) has what a step must combine across tasks: a
weighted mean loss (with `loss_denominator`), Adam, a moving mean of the
features (`UPDATE_OPS`, as batch norm's statistics), an L2 regularizer, a
`tower_local_scope("sum")` count of the rows seen and the global step;
optionally a synchronized batch norm, an embedding (sparse gradients), an
embedding each for SGD, Adam, Adagrad and FTRL (`--sparse-optimizers`) and
a second optimizer call whose gradient is not computed from the rows;
in-batch negatives through `replicate.all_rows` and `replicate.row_offset`
(`--negatives`: every row's query against every row's item of the whole
batch, every task's); the gradients clipped by global norm between
`compute_gradients` or `tf.gradients` and `apply_gradients` (`--clip`,
with SGD, on which the clip shows most; the tests' reference also trains
`"unclipped"`, the same SGD without the clip).
Each task has 2 towers (virtual CPUs; `--towers`), trained by
`tf.estimator.train_and_evaluate` after `replicate.start_server`.

Each training task writes every global variable's value when it stops, to
`MODEL_DIR/values-<job>-<index>.npz`, and prints `sync_job: <phase>` lines
the fault tests wait for: `started` (before TensorFlow starts a session),
`step <global step>` after each step, `done` at the end.
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf

import replicate

FEATURES = 5
CLASSES = 3
VOCABULARY = 11
CLIP = 0.05  # `--clip`'s global norm: below the batch's (it clips)


# The optimizers of `--sparse-optimizers`' embeddings, by table name.
SPARSE_OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.3),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(
        0.3, l1_regularization_strength=0.01,
        l2_regularization_strength=0.01),
}


def batch(rank, step, rows):
  """The rows of task `rank`'s batch `step`: (x, labels, weights)."""
  random = np.random.RandomState(1000 * rank + step)
  x = random.normal(size=(rows, FEATURES)).astype(np.float32)
  labels = random.randint(0, CLASSES, size=rows).astype(np.int64)
  weights = random.uniform(0.5, 2.0, size=rows).astype(np.float32)
  return x, labels, weights


def parse_batches(text):
  """`"6,5*3;4"`: per task, its batches' rows (`5*3` is 5, 5, 5)."""
  tasks = []
  for task in text.split(";"):
    rows = []
    for part in task.split(","):
      value, _, times = part.partition("*")
      rows.extend([int(value)] * int(times or 1))
    tasks.append(rows)
  return tasks


def model_fn(features, labels, mode, params):
  """The model every task (and the one-device reference) builds."""
  inputs = features["x"]
  if params.get("embedding"):
    # Sparse gradients: the rows each batch looks up.
    table = tf.compat.v1.get_variable(
        "embedding", [VOCABULARY, 3],
        initializer=tf.compat.v1.random_normal_initializer(seed=3))
    ids = tf.cast(tf.abs(inputs[:, :2]) * 7, tf.int64) % VOCABULARY
    inputs = tf.concat([inputs, tf.reduce_sum(
        tf.nn.embedding_lookup(table, ids), axis=1)], axis=1)
  tables = {}
  if params.get("sparse_optimizers"):
    # An embedding per optimizer, each trained by its own (sparse updates:
    # SGD's scatter, Adam's, Adagrad's and FTRL's duplicate sums).
    ids = tf.cast(tf.abs(inputs[:, 2:4]) * 7, tf.int64) % VOCABULARY
    looked_up = []
    for name in SPARSE_OPTIMIZERS:
      tables[name] = tf.compat.v1.get_variable(
          "table_" + name, [VOCABULARY, 2],
          initializer=tf.compat.v1.random_normal_initializer(seed=4))
      looked_up.append(tf.reduce_sum(
          tf.nn.embedding_lookup(tables[name], ids), axis=1))
    inputs = tf.concat([inputs] + looked_up, axis=1)
  hidden_layer = tf.compat.v1.layers.Dense(
      params["hidden"], activation=tf.nn.tanh, name="hidden",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1),
      kernel_regularizer=tf.keras.regularizers.l2(0.01))
  hidden = hidden_layer(inputs)
  layers = [hidden_layer]
  if params.get("batch_norm"):
    hidden = tf.compat.v1.layers.batch_normalization(
        hidden, training=mode == tf.estimator.ModeKeys.TRAIN, name="norm",
        fused=params["batch_norm"] == "fused")
  layers.append(tf.compat.v1.layers.Dense(
      CLASSES, name="logits",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2)))
  logits = layers[-1](hidden)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, weights=features["w"],
      reduction=tf.compat.v1.losses.Reduction.MEAN)
  if params.get("negatives"):
    loss += _in_batch_negatives(features, layers)
  if not params.get("read_loss"):  # else read from the graph
    replicate.loss_denominator(tf.reduce_sum(features["w"]))
  loss += tf.compat.v1.losses.get_regularization_loss()
  # A statistic of the rows, updated as batch norm's are (UPDATE_OPS).
  feature_mean = tf.compat.v1.get_variable(
      "feature_mean", [FEATURES], trainable=False,
      initializer=tf.compat.v1.zeros_initializer())
  tf.compat.v1.add_to_collection(
      tf.compat.v1.GraphKeys.UPDATE_OPS, feature_mean.assign_sub(
          (feature_mean - tf.reduce_mean(features["x"], 0)) * 0.1))
  with replicate.tower_local_scope("sum"):
    seen = tf.compat.v1.get_variable(
        "rows_seen", [], tf.float32, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
  count = seen.assign_add(tf.cast(tf.shape(labels)[0], tf.float32))
  clip = params.get("clip")
  optimizer = params["wrap"](
      tf.compat.v1.train.GradientDescentOptimizer(0.5) if clip else
      tf.compat.v1.train.AdamOptimizer(0.05))
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    # The tables have optimizers of their own.
    # (Tower 0's variables by name: each tower trains its copies of them.)
    trained = [v for v in tf.compat.v1.trainable_variables()
               if not v.op.name.startswith("table_")] if tables else None
    step = tf.compat.v1.train.get_or_create_global_step()
    if clip == "compute":
      grads, variables = zip(*optimizer.compute_gradients(loss,
                                                          var_list=trained))
    elif clip == "gradients":  # the layers' own: a tower's copies (not
      # trainable, so layer.weights)
      variables = [v for layer in layers for v in layer.weights]
      grads = tf.gradients(loss, variables)
    if clip in ("compute", "gradients"):
      grads, _ = tf.clip_by_global_norm(grads, CLIP)
      train_op = optimizer.apply_gradients(zip(grads, variables), step)
    else:  # "unclipped": SGD as the clipped runs, for comparison
      train_op = optimizer.minimize(loss, step, var_list=trained)
  for name, table in tables.items():
    sparse = params["wrap"](SPARSE_OPTIMIZERS[name]())
    train_op = tf.group(train_op, sparse.minimize(loss, var_list=[table]))
  if params.get("weight_decay"):
    # A second optimizer call whose gradient is not computed from the rows
    # (decoupled weight decay): it must count once, not once per task.
    decay = params["wrap"](tf.compat.v1.train.GradientDescentOptimizer(0.5))
    with tf.control_dependencies([train_op]):
      kernel = hidden_layer.kernel
      train_op = decay.apply_gradients([(0.1 * kernel, kernel)])
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(train_op, count))


def _in_batch_negatives(features, layers):
  """Two-tower retrieval's loss, in-batch negatives: row r's query against
  every item of the whole batch, its own (row r of the batch) the label;
  weighted and divided as the model's other loss term."""
  towers = []
  for name, seed in (("query", 5), ("item", 6)):
    layers.append(tf.compat.v1.layers.Dense(
        3, activation=tf.nn.tanh, name=name,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(
            seed=seed)))
    towers.append(layers[-1](features["x"]))
  query, item = towers
  similarity = tf.matmul(query, replicate.all_rows(item), transpose_b=True)
  targets = tf.range(tf.shape(query)[0]) + replicate.row_offset()
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets,
                                                        logits=similarity)
  return tf.math.divide_no_nan(tf.reduce_sum(features["w"] * xent),
                              tf.reduce_sum(features["w"]))


def input_fn_for(batches, model_dir, static=False):
  """An input_fn yielding task `rank`'s batches, then ending.

  A job resumed from a checkpoint of global step s starts at batch s, so
  that the steps after a restart see the data an uninterrupted run would.
  """

  def input_fn(rank):
    latest = tf.train.latest_checkpoint(model_dir)
    start = int(latest.rsplit("-", 1)[1]) if latest else 0

    def generate():
      for step, rows in enumerate(batches[rank][start:], start=start):
        x, labels, weights = batch(rank, step, rows)
        yield {"x": x, "w": weights}, labels

    # A static batch (every batch of the task the same size, known when
    # the graph is built), or one known only at run time.
    rows = batches[rank][0] if static else None
    return tf.data.Dataset.from_generator(
        generate, output_signature=(
            {"x": tf.TensorSpec([rows, FEATURES], tf.float32),
             "w": tf.TensorSpec([rows], tf.float32)},
            tf.TensorSpec([rows], tf.int64)))

  return input_fn


class Report(tf.compat.v1.train.SessionRunHook):
  """Prints the phases; writes every global variable's value at the end
  (`saved(variables)`: which of them)."""

  def __init__(self, path, prefix="sync_job"):
    self._path = path
    self._prefix = prefix

  def say(self, text):
    print("{}: {}".format(self._prefix, text), flush=True)

  def begin(self):
    self._variables = tf.compat.v1.global_variables()
    self._step = tf.compat.v1.train.get_global_step()
    self.say("started")

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._step)

  def after_run(self, run_context, run_values):
    self.say("step {}".format(run_values.results + 1))

  def saved(self, variables):
    return variables

  def end(self, session):
    values = session.run({v.op.name: v
                          for v in self.saved(self._variables)})
    np.savez(self._path, **values)
    self.say("done")


def _of_task(values, rank):
  """`values` ("4" or "4,5,4"): this task's, as an int."""
  values = values.split(",")
  return int(values[rank] if len(values) > 1 else values[0])


def main(argv):
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
  parser = argparse.ArgumentParser()
  parser.add_argument("model_dir")
  parser.add_argument("max_steps", type=int)
  parser.add_argument("batches")
  parser.add_argument("--hidden", default="4",
                      help="hidden units, or per task in rank order: 4,5")
  parser.add_argument("--towers", default="2",
                      help="towers (virtual CPUs) a task, or per task: 1,2")
  parser.add_argument("--static", action="store_true",
                      help="static batch shapes (a task's batches alike)")
  parser.add_argument("--weight-decay", action="store_true",
                      help="a second optimizer call: decay not from rows")
  parser.add_argument("--read-loss", action="store_true",
                      help="no loss_denominator: the loss rule reads it")
  parser.add_argument("--embedding", action="store_true",
                      help="an embedding lookup: sparse gradients")
  parser.add_argument("--sparse-optimizers", action="store_true",
                      help="an embedding each for SGD, Adam, Adagrad, FTRL")
  parser.add_argument("--negatives", action="store_true",
                      help="in-batch negatives through replicate.all_rows")
  parser.add_argument("--clip", choices=["compute", "gradients"],
                      help="clip by global norm after compute_gradients or "
                      "tf.gradients")
  parser.add_argument("--batch-norm", choices=["fused", "plain"],
                      help="a batch norm after the hidden layer, "
                      "synchronized across every task's towers")
  arguments = parser.parse_args(argv)
  tf_config = json.loads(os.environ["TF_CONFIG"])
  task = tf_config["task"]
  cluster = tf_config["cluster"]
  ranks = [("chief", 0)] + [("worker", i)
                            for i in range(len(cluster.get("worker", [])))]
  rank = ranks.index((task["type"], task["index"]))
  config = tf.estimator.RunConfig(
      model_dir=arguments.model_dir, save_checkpoints_steps=1000,
      experimental_max_worker_delay_secs=0,
      session_config=tf.compat.v1.ConfigProto(
          device_count={"CPU": _of_task(arguments.towers, rank)}))
  replicate.start_server(config)
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(model_fn, variable_strategy="replicated",
                                   sync_batch_norm=bool(arguments.batch_norm)),
      config=config,
      params={"hidden": _of_task(arguments.hidden, rank),
              "batch_norm": arguments.batch_norm,
              "embedding": arguments.embedding,
              "sparse_optimizers": arguments.sparse_optimizers,
              "weight_decay": arguments.weight_decay,
              "read_loss": arguments.read_loss,
              "negatives": arguments.negatives, "clip": arguments.clip,
              "wrap": replicate.TowerOptimizer})
  path = os.path.join(arguments.model_dir,
                      "values-{}-{}.npz".format(task["type"], task["index"]))
  input_fn = input_fn_for(parse_batches(arguments.batches),
                          arguments.model_dir, arguments.static)
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(lambda: input_fn(rank),
                             max_steps=arguments.max_steps,
                             hooks=[Report(path)]),
      tf.estimator.EvalSpec(lambda: input_fn(rank)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
