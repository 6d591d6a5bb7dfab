"""The job every task of `python -m benchmarks.across_workers` runs.

    python benchmarks/across_workers_job.py MODE [options]

MODE is how the cluster in `TF_CONFIG` trains (or, for `probe`, what it
times):

- `replicate`: `replicate.start_server(run_config)`, then
  `replicate_model_fn(model_fn, variable_strategy="replicated")` with one
  tower per virtual CPU (`--towers`) of each chief and worker task, no ps;
- `mwms`: `tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy`
  in `RunConfig(train_distribute=...)`, under
  `tf.compat.v1.disable_eager_execution()`. On a CPU-only machine it runs
  one replica per task, whatever `device_count` says (it asks for GPUs);
- `ps-sync`: one ps task holds the variables; each chief and worker task
  trains `--towers` towers with `replicate_model_fn` (the default
  `parameter_server` strategy) and `SyncReplicasOptimizer` (one update per
  round of every worker's gradients) wrapped in `replicate.TowerOptimizer`,
  with its hook;
- `probe`: no training. Every task times bare `CollectiveReduceV2`s across
  the tasks (one device each, `tf.distribute.Server` with the chief as the
  group leader in the server's own config), of `--probe-elements` float32
  elements each, and `--probe-concurrent` 1-element ones in one run,
  without an op timeout, then one and `--probe-concurrent` 1-element ones
  with a timeout of `--probe-timeout` seconds (replicate's collectives have
  one), `--probe-rounds` times, interleaved with runs of no collective.

- `hybrid` (`--model ctr`): as `replicate`, in a cluster with one ps task
  (`start_server` returns None there, and the Estimator serves it): the
  partitioned variables (the embedding tables) live on the ps task, every
  other variable is replicated and all-reduced;
- `ps-async` (`--model ctr`): as `ps-sync` with the plain optimizer in
  `replicate.TowerOptimizer`: every task updates the ps task's variables on
  its own, asynchronously.

Each training task reads its own fixed batch of `--batch / tasks` rows
(random, seeded by its rank) from `from_tensors(...).repeat()`, so the
global batch is the same whatever the number of tasks, and the input costs
nothing. `--model mlp` (the default) is an MLP 784-`--hidden`-10 with plain
gradient descent; `--model ctr` is `benchmarks/ctr_model.py`'s CTR model
(`--fields` int64 ids, embedding tables of `--table-rows` rows in all,
`--dim` wide, each in `--shards` partitions, an MLP `--hidden` on top,
Adagrad), whose first SMALL_STEPS local steps take a quarter of the task's
batch (not with `mwms`, see `_train`); the chief traces one step of each
size in the warm-up and counts the bytes that crossed between tasks
(`ctr_model.step_bytes`).

The chief prints one line `across_workers: {json}`: for training, the
global steps and seconds it timed after `--warmup` global steps (from the
end of step `--warmup` to the end of the last), how many collective ops its
training graph holds and how many threads it has at the end (with `--model
ctr` also the traced steps' bytes, the rows they looked up and the chief's
peak resident memory); for `probe`,
the median milliseconds of each fetch.
"""

import argparse
import json
import os
import sys

MODES = ("replicate", "hybrid", "mwms", "ps-async", "ps-sync", "probe")


def make_parser():
  """The job's command line (the benchmark's runner gives it)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=MODES)
  parser.add_argument("--model-dir", default=None)
  parser.add_argument("--model", choices=("mlp", "ctr"), default="mlp")
  parser.add_argument("--hidden", default=None,
                      help="default 1024,1024 (mlp), 256,128 (ctr)")
  parser.add_argument("--fields", type=int, default=26)
  parser.add_argument("--table-rows", type=int, default=1048576,
                      help="rows of all the CTR model's tables together")
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--shards", type=int, default=2)
  parser.add_argument("--batch", type=int, default=384)
  parser.add_argument("--towers", type=int, default=2)
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--learning-rate", type=float, default=None,
                      help="default 0.001 (mlp), 0.05 (ctr)")
  parser.add_argument("--probe-elements", default="1,262144")
  parser.add_argument("--probe-rounds", type=int, default=200)
  parser.add_argument("--probe-concurrent", type=int, default=32)
  parser.add_argument("--probe-timeout", type=float, default=2.0)
  return parser


if __name__ == "__main__":
  # --help and a bad flag answer before TensorFlow's import, which takes
  # seconds; main() parses the command line again.
  make_parser().parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import ctr_model, job_models, job_probe, job_timer  # noqa: E402

# The local steps whose bytes the chief counts (traced, in the warm-up): one
# at a quarter of the batch, one at the whole batch (see _ctr_input_fn_for).
SMALL_STEPS = 4
TRACED_STEPS = {2: "quarter", SMALL_STEPS + 2: "whole"}
PREFIX = "across_workers: "


def main(argv=None, timer_class=job_timer.Timer):
  """Runs this task; `timer_class`: the chief's hook (`benchmarks.step_trace`
  gives one that traces)."""
  args = make_parser().parse_args(argv)
  if args.mode == "mwms":
    # The V1 class with Estimator needs graph mode (its own error says so).
    tf.compat.v1.disable_eager_execution()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  tf_config = json.loads(os.environ["TF_CONFIG"])
  cluster = tf_config["cluster"]
  task = (tf_config["task"]["type"], tf_config["task"]["index"])
  ranks = [("chief", 0)] + [("worker", i)
                            for i in range(len(cluster.get("worker", [])))]
  if args.mode == "probe":
    return job_probe.probe(args, cluster, task, ranks, _report)
  return _train(args, cluster, task, ranks, timer_class)


def _report(record):
  print(PREFIX + json.dumps(record), flush=True)


# --- training ---------------------------------------------------------------


def _train(args, cluster, task, ranks, timer_class):
  tasks = len(ranks)
  rows = args.batch // tasks
  is_training_task = task in ranks
  rank = ranks.index(task) if is_training_task else None
  session_config = tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})
  kwargs = dict(model_dir=args.model_dir, save_checkpoints_steps=10**9,
                save_checkpoints_secs=None, save_summary_steps=None,
                log_step_count_steps=None,
                experimental_max_worker_delay_secs=0)
  import replicate  # pylint: disable=import-outside-toplevel
  model_for = _ctr_model_fn_for(args) if args.model == "ctr" else (
      _mlp_model_fn_for(args))

  if args.mode == "mwms":
    experimental = tf.compat.v1.distribute.experimental
    strategy = experimental.MultiWorkerMirroredStrategy()
    config = tf.estimator.RunConfig(train_distribute=strategy, **kwargs)
    model_fn = model_for(lambda optimizer: (optimizer, []))
  elif args.mode in ("replicate", "hybrid"):
    # hybrid: the same, in a cluster with ps tasks, whose partitioned
    # variables (the embedding tables) live on the ps tasks.
    config = tf.estimator.RunConfig(session_config=session_config, **kwargs)
    replicate.start_server(config)  # None on a ps task, which serves below
    model_fn = replicate.replicate_model_fn(
        model_for(lambda o: (replicate.TowerOptimizer(o), [])),
        variable_strategy="replicated")
  else:  # ps-sync, ps-async
    if is_training_task:
      _serve_ps_cluster_task(task, cluster, args.towers)
    config = tf.estimator.RunConfig(session_config=session_config, **kwargs)

    def wrap_sync(optimizer):
      sync = replicate.TowerOptimizer(
          tf.compat.v1.train.SyncReplicasOptimizer(
              optimizer, replicas_to_aggregate=tasks,
              total_num_replicas=tasks))
      return sync, [sync.make_session_run_hook(config.is_chief)]

    model_fn = replicate.replicate_model_fn(
        model_for(wrap_sync if args.mode == "ps-sync" else (
            lambda o: (replicate.TowerOptimizer(o), []))),
        variable_strategy="parameter_server")
  estimator = tf.estimator.Estimator(model_fn, config=config)
  traced = {}
  if args.model == "ctr" and task == ("chief", 0):  # mwms: the whole only
    traced = {step: name for step, name in TRACED_STEPS.items()
              if args.mode != "mwms" or name == "whole"}
  timer = timer_class(args.warmup, traced)
  if args.model == "ctr":
    # MultiWorkerMirroredStrategy's all-gathers keep the shape of their
    # first run (a quarter batch first fails the next step), so it runs the
    # whole batch from its first step, and its quarter is not counted.
    input_fn, touched = _ctr_input_fn_for(args, rank or 0, rows,
                                          quarter_first=args.mode != "mwms")
  else:
    input_fn, touched = job_models.mlp_input_fn_for(rank or 0, rows), None
  max_steps = args.warmup + args.steps
  if args.mode == "ps-async":
    # Every task's step is a global step, and the tasks train on until the
    # run is stopped, so they train through the whole of the chief's timing.
    # The chief stops itself once it has timed `--steps` x tasks global
    # steps (its own hook: the others' steps may reach any bound first).
    max_steps = 10**9
    timer.stop_after = args.steps * tasks
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=max_steps, hooks=[timer]),
      tf.estimator.EvalSpec(input_fn, steps=1))
  if task == ("chief", 0):
    if timer.start is None or timer.last[1] <= timer.start[1]:
      raise RuntimeError("The chief timed no global step after the {} "
                         "warm-up steps.".format(args.warmup))
    record = {"mode": args.mode, "tasks": tasks, "batch": args.batch,
              "global_steps": timer.last[1] - timer.start[1],
              "seconds": timer.last[0] - timer.start[0],
              "local_steps": timer.local_steps,
              "collectives": timer.collectives,
              "threads": job_probe.threads()}
    if args.model == "ctr":
      record.update(model="ctr", bytes=timer.bytes, touched=touched,
                    memory_mb=job_timer.resident_mb())
    _report(record)
  return 0


def _mlp_model_fn_for(args):
  hidden = [int(units) for units in (args.hidden or "1024,1024").split(",")
            if units]
  return lambda wrap: job_models.mlp_model_fn_for(
      hidden, args.learning_rate or 0.001, wrap)


def _ctr_model_fn_for(args):
  hidden = [int(units) for units in (args.hidden or "256,128").split(",")
            if units]
  rows_a_table = ctr_model.table_rows(args.table_rows, args.fields)
  return lambda wrap: job_models.ctr_model_fn_for(
      args.fields, rows_a_table, args.dim, args.shards, hidden,
      args.learning_rate or 0.05, wrap)


def _ctr_input_fn_for(args, rank, rows, quarter_first=True):
  """This task's fixed batch of `rows` rows: a quarter of it for the first
  SMALL_STEPS local steps (if `quarter_first`), then all of it, repeated;
  and the rows each looks up (ids over all fields, and how many
  distinct)."""
  rows_a_table = ctr_model.table_rows(args.table_rows, args.fields)
  features, labels = ctr_model.batch(rank, rows, args.fields, rows_a_table)
  quarter = rows // 4
  small = ({k: v[:quarter] for k, v in features.items()}, labels[:quarter])

  def distinct(part):
    return int(sum(len(np.unique(ids)) for ids in part.values()))

  touched = {"quarter": {"rows": quarter, "ids": quarter * args.fields,
                         "distinct": distinct(small[0])},
             "whole": {"rows": rows, "ids": rows * args.fields,
                       "distinct": distinct(features)}}

  def input_fn():
    whole = tf.data.Dataset.from_tensors((features, labels)).repeat()
    if not quarter_first:
      return whole
    return tf.data.Dataset.from_tensors(small).repeat(SMALL_STEPS).concatenate(
        whole)

  return input_fn, touched


_SERVERS = []


def _serve_ps_cluster_task(task, cluster, towers):
  """A chief's or worker's server with `towers` virtual CPUs.

  The Estimator starts a task's server with only the session config's
  `gpu_options`, so virtual CPUs would not reach it (see
  tests/cluster_job.py); the ps task keeps the Estimator's own server.
  """
  tf_config = json.loads(os.environ["TF_CONFIG"])
  tf_config["environment"] = "google"
  os.environ["TF_CONFIG"] = json.dumps(tf_config)
  _SERVERS.append(tf.distribute.Server(
      tf.train.ClusterSpec(cluster), job_name=task[0], task_index=task[1],
      config=tf.compat.v1.ConfigProto(device_count={"CPU": towers})))


if __name__ == "__main__":
  sys.exit(main())
