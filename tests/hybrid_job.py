"""The job every task of the tests with ps tasks and `"replicated"` runs.

  python tests/hybrid_job.py MODEL_DIR MAX_STEPS BATCHES
      [--optimizer {adam,adagrad,sgd,ftrl}] [--towers N[,N...]]
      [--shards S] [--canned | --canned-dnn] [--fields F] [--vocabulary V] [--dimension D]
      [--report-memory] [--partitioned-statistic] [--save-every N]
      [--clip NORM [--clip-by {code,transformer}]]

A CTR model as its users write it: `FIELDS` categorical fields (or
`--fields`), each an
embedding table made by `get_variable(..., partitioner=
fixed_size_partitioner(S))` and looked up with `embedding_lookup`
(sparse gradients), a dense feature, a hidden layer and a logistic loss,
trained by one optimizer (`--clip`: its gradients clipped by their
global norm between `compute_gradients` and `apply_gradients`, or with
`--clip-by transformer` by TowerOptimizer's `gradient_transformers`). `--canned`: `tf.compat.v1.estimator.
DNNLinearCombinedClassifier`'s model_fn with `input_layer_partitioner`;
`--canned-dnn`: `DNNClassifier`'s, whose hidden layers TensorFlow
partitions too (read whole: replicated).
The tables live on the ps tasks, everything else on every task's towers.

`BATCHES` as in `tests/sync_job.py`: per task in rank order, the rows of
each batch (`"5,2;3,6"`); a job restarted from a checkpoint of global step
s starts at batch s. Each training task writes every global variable's
value it can read when it stops, to `MODEL_DIR/values-<job>-<index>.npz`,
and prints `hybrid_job: started`, `hybrid_job: step <global step>` and
`hybrid_job: done`; a ps task prints `hybrid_job: ps <pid>` and serves.
With `REPLICATE_TF1_BEHAVIOR=1` in its environment, every task runs
under TensorFlow 1 behaviour, with resource variables.
`--report-memory`: each training task also prints where each variable
lives (`hybrid_job: placed <name> <device>`, its copies included) and, at
the end, its peak resident memory (`hybrid_job: resident MB <n>`).
"""

import argparse
import json
import os
import resource
import sys

import numpy as np
import tensorflow as tf

import replicate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sync_job  # noqa: E402  pylint: disable=wrong-import-position

FIELDS = 3
VOCABULARY = 40
DIMENSION = 4
DENSE = 2
SEED = 7  # the graph's: the canned model's initializers have no seed

OPTIMIZERS = sync_job.SPARSE_OPTIMIZERS  # sgd, adam, adagrad, ftrl


def batch(rank, step, rows, fields=FIELDS):
  """Task `rank`'s batch `step`: ids mostly from 6 hot rows, so that rows
  repeat within and across tasks, a few anywhere; a dense feature; 0/1
  labels."""
  random = np.random.RandomState(1000 * rank + step)
  hot = random.randint(0, 6, size=(rows, fields))
  far = random.randint(0, VOCABULARY, size=(rows, fields))
  ids = np.where(random.uniform(size=(rows, fields)) < 0.7, hot, far)
  x = random.normal(size=(rows, DENSE)).astype(np.float32)
  labels = random.randint(0, 2, size=(rows, 1)).astype(np.float32)
  return {"ids": ids.astype(np.int64), "x": x}, labels


def model_fn(features, labels, mode, params):
  """The model every task (and the one-device reference) builds."""
  partitioner = tf.compat.v1.fixed_size_partitioner(params["shards"])
  looked_up = []
  for field in range(features["ids"].shape[1]):
    table = tf.compat.v1.get_variable(
        "table_{}".format(field),
        [params.get("vocabulary", VOCABULARY),
         params.get("dimension", DIMENSION)],
        initializer=tf.compat.v1.random_normal_initializer(seed=field),
        partitioner=partitioner)
    looked_up.append(tf.compat.v1.nn.embedding_lookup(
        table, features["ids"][:, field], partition_strategy="div"))
  if params.get("partitioned_statistic"):
    # A moving mean of the dense feature, partitioned and looked up by
    # rows: on the ps tasks, where every task would update it (refused).
    mean = tf.compat.v1.get_variable(
        "feature_mean", [8, DENSE], trainable=False, partitioner=partitioner,
        initializer=tf.compat.v1.zeros_initializer())
    tf.compat.v1.add_to_collection(
        tf.compat.v1.GraphKeys.UPDATE_OPS, tf.compat.v1.assign_add(
            mean, tf.zeros([8, DENSE]) + tf.reduce_mean(features["x"], 0)))
    looked_up.append(tf.compat.v1.nn.embedding_lookup(
        mean, features["ids"][:, 0] % 8, partition_strategy="div"))
  inputs = tf.concat(looked_up + [features["x"]], axis=1)
  hidden = tf.compat.v1.layers.dense(
      inputs, 8, activation=tf.nn.tanh, name="hidden",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      hidden, 1, name="logits",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sigmoid_cross_entropy(labels, logits)
  if params.get("clip_by") == "transformer":
    norm = params["clip"]
    clip = lambda pairs: list(zip(  # noqa: E731
        tf.clip_by_global_norm([g for g, _ in pairs], norm)[0],
        [v for _, v in pairs]))
    optimizer = params["wrap"](OPTIMIZERS[params["optimizer"]](),
                               gradient_transformers=[clip])
    params = dict(params, clip=0.0)
  else:
    optimizer = params["wrap"](OPTIMIZERS[params["optimizer"]]())
  step = tf.compat.v1.train.get_or_create_global_step()
  if not params.get("clip"):
    train_op = optimizer.minimize(loss, step)
  else:
    # Code between compute_gradients and apply_gradients that reads the
    # tables' gradients too: their norm scales every gradient.
    grads, variables = zip(*optimizer.compute_gradients(loss))
    clipped, _ = tf.clip_by_global_norm(grads, params["clip"])
    train_op = optimizer.apply_gradients(zip(clipped, variables), step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def canned_model_fn(features, labels, mode, params, config):
  """A canned wide & deep model's model_fn, its inputs partitioned."""
  columns = [tf.compat.v1.feature_column.embedding_column(
      tf.compat.v1.feature_column.categorical_column_with_identity(
          "id_{}".format(f), VOCABULARY), DIMENSION)
             for f in range(features["ids"].shape[1])]
  wide = [tf.compat.v1.feature_column.categorical_column_with_identity(
      "id_0", VOCABULARY)]
  estimator = tf.compat.v1.estimator.DNNLinearCombinedClassifier(
      linear_feature_columns=wide, dnn_feature_columns=columns,
      dnn_hidden_units=[8],
      dnn_optimizer=params["wrap"](OPTIMIZERS[params["optimizer"]]()),
      linear_optimizer=params["wrap"](OPTIMIZERS["ftrl"]()),
      input_layer_partitioner=tf.compat.v1.fixed_size_partitioner(
          params["shards"]),
      config=config)
  split = {"id_{}".format(f): features["ids"][:, f]
           for f in range(features["ids"].shape[1])}
  return estimator.model_fn(split, labels, mode, config)


def canned_dnn_model_fn(features, labels, mode, params, config):
  """A canned DNN's model_fn (TF 1's DNNClassifier): its embeddings
  partitioned by `input_layer_partitioner` and looked up by rows, its
  hidden layers partitioned by TensorFlow's own `dnn` partitioner (as
  many parts as ps tasks, at most) and read whole."""
  columns = [tf.compat.v1.feature_column.embedding_column(
      tf.compat.v1.feature_column.categorical_column_with_identity(
          "id_{}".format(f), VOCABULARY), DIMENSION)
             for f in range(features["ids"].shape[1])]
  estimator = tf.compat.v1.estimator.DNNClassifier(
      hidden_units=[8, 4], feature_columns=columns,
      optimizer=params["wrap"](OPTIMIZERS[params["optimizer"]]()),
      input_layer_partitioner=tf.compat.v1.fixed_size_partitioner(
          params["shards"]),
      config=config)
  split = {"id_{}".format(f): features["ids"][:, f]
           for f in range(features["ids"].shape[1])}
  return estimator.model_fn(split, labels, mode, config)


MODEL_FNS = {"ctr": model_fn, "canned": canned_model_fn,
             "canned-dnn": canned_dnn_model_fn}


def input_fn_for(batches, model_dir, fields=FIELDS):
  """Task `rank`'s batches, then the end (from the checkpoint's step)."""

  def input_fn(rank):
    latest = tf.train.latest_checkpoint(model_dir)
    start = int(latest.rsplit("-", 1)[1]) if latest else 0

    def generate():
      for step, rows in enumerate(batches[rank][start:], start=start):
        yield batch(rank, step, rows, fields)

    return tf.data.Dataset.from_generator(
        generate, output_signature=(
            {"ids": tf.TensorSpec([None, fields], tf.int64),
             "x": tf.TensorSpec([None, DENSE], tf.float32)},
            tf.TensorSpec([None, 1], tf.float32)))

  return input_fn


class _Report(sync_job.Report):
  """`sync_job.Report`, and with `report_memory` where each variable lives
  and the peak resident memory before the values (but the ps tasks':
  reading those would bring them here)."""

  def __init__(self, path, report_memory):
    super().__init__(path, prefix="hybrid_job")
    self._report_memory = report_memory

  def begin(self):
    if self._report_memory:
      for variable in (tf.compat.v1.global_variables() +
                       tf.compat.v1.local_variables()):
        self.say("placed {} {}".format(variable.op.name, variable.op.device))
    super().begin()

  def saved(self, variables):
    if not self._report_memory:
      return variables
    self.say("resident MB {}".format(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
    return [v for v in variables if "/job:ps/" not in v.op.device]


def main(argv):
  if os.environ.get("REPLICATE_TF1_BEHAVIOR") == "1":
    # TensorFlow 1 behaviour, as a model written for TF 1 runs; resource
    # variables, which "replicated" needs (it refuses to copy a ref
    # variable, saying so), as on one machine.
    tf.compat.v1.disable_v2_behavior()
    if "--ref-variables" not in argv:  # TF 1's default: refused
      tf.compat.v1.enable_resource_variables()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
  parser = argparse.ArgumentParser()
  parser.add_argument("model_dir")
  parser.add_argument("max_steps", type=int)
  parser.add_argument("batches")
  parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
  parser.add_argument("--towers", default="2",
                      help="towers (virtual CPUs) a task, or per task: 1,2")
  parser.add_argument("--shards", type=int, default=2,
                      help="parts of each table (fixed_size_partitioner)")
  parser.add_argument("--canned", action="store_true",
                      help="DNNLinearCombinedClassifier's model_fn")
  parser.add_argument("--canned-dnn", action="store_true",
                      help="DNNClassifier's model_fn")
  parser.add_argument("--fields", type=int, default=FIELDS,
                      help="categorical fields, a table each")
  parser.add_argument("--vocabulary", type=int, default=VOCABULARY,
                      help="rows of each table")
  parser.add_argument("--dimension", type=int, default=DIMENSION,
                      help="columns of each table")
  parser.add_argument("--clip", type=float, default=0.0,
                      help="clip the gradients by this global norm")
  parser.add_argument("--clip-by", default="code",
                      choices=["code", "transformer"],
                      help="--clip in the model_fn's code, or as "
                      "TowerOptimizer's gradient_transformers")
  parser.add_argument("--save-every", type=int, default=1000,
                      help="the chief's checkpoints, every this many steps")
  parser.add_argument("--partitioned-statistic", action="store_true",
                      help="a partitioned variable that is not trainable")
  parser.add_argument("--ref-variables", action="store_true",
                      help="with REPLICATE_TF1_BEHAVIOR=1: TF 1's ref "
                      "variables, not resource variables")
  parser.add_argument("--report-memory", action="store_true",
                      help="print placements and peak resident memory")
  arguments = parser.parse_args(argv)
  tf_config = json.loads(os.environ["TF_CONFIG"])
  task = tf_config["task"]
  cluster = tf_config["cluster"]
  ranks = [("chief", 0)] + [("worker", i)
                            for i in range(len(cluster.get("worker", [])))]
  rank = ranks.index((task["type"], task["index"])) if task[
      "type"] != "ps" else 0
  config = tf.estimator.RunConfig(
      model_dir=arguments.model_dir,
      save_checkpoints_steps=arguments.save_every,
      tf_random_seed=SEED,
      experimental_max_worker_delay_secs=0,
      session_config=tf.compat.v1.ConfigProto(
          device_count={"CPU": sync_job._of_task(arguments.towers, rank)}))
  if task["type"] == "ps":
    print("hybrid_job: ps {}".format(os.getpid()), flush=True)
  # On a ps task it serves, and never returns to train_and_evaluate.
  replicate.start_server(config)
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(
          MODEL_FNS["canned" if arguments.canned else "canned-dnn" if
                    arguments.canned_dnn else "ctr"],
          variable_strategy="replicated"),
      config=config,
      params={"optimizer": arguments.optimizer, "shards": arguments.shards,
              "vocabulary": arguments.vocabulary,
              "dimension": arguments.dimension,
              "clip": arguments.clip, "clip_by": arguments.clip_by,
              "partitioned_statistic": arguments.partitioned_statistic,
              "wrap": replicate.TowerOptimizer})
  path = os.path.join(arguments.model_dir,
                      "values-{}-{}.npz".format(task["type"], task["index"]))
  input_fn = input_fn_for(sync_job.parse_batches(arguments.batches),
                          arguments.model_dir, arguments.fields)
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(lambda: input_fn(rank),
                             max_steps=arguments.max_steps,
                             hooks=[_Report(path, arguments.report_memory)]),
      tf.estimator.EvalSpec(lambda: input_fn(rank)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
