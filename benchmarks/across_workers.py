"""python -m benchmarks.across_workers: synchronous training across local tasks.

Trains the same MLP on the same global batch with 1, 2 and 3 local tasks
(`--tasks`), each task its own process on loopback gRPC
(`replicate.launch.LocalCluster`, which runs `benchmarks/across_workers_job.py`
once per task), three ways:

- `replicate`: `replicate.start_server` and `replicate_model_fn(...,
  variable_strategy="replicated")`, `--towers` towers a task, no ps;
- `mwms`: `tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy`
  through `RunConfig(train_distribute=...)`; on CPUs it runs one replica a
  task (it counts GPUs only), so each task computes on one device;
- `ps-sync`: one ps task plus the training tasks, `SyncReplicasOptimizer`
  wrapped in `replicate.TowerOptimizer`, `variable_strategy=
  "parameter_server"`, `--towers` towers a task.

The global batch (`--batch`) is split evenly over the tasks. The chief
times `--steps` global steps after `--warmup` untimed ones (a SessionRunHook:
from the end of the last warm-up step to the end of the last step), so
examples/sec = global batch x global steps / seconds, without start-up.
Each repeat runs every (approach, tasks) once, in reverse order on odd
repeats; ratios are paired within a repeat. After each repeat a probe times
bare cross-process `CollectiveReduceV2`s between `--probe-tasks` tasks: the
per-collective overhead and loopback throughput that the cost model of a
step on a real cluster (`benchmarks.step_cost_model`) takes.

All tasks share this machine's cores, so the figures show what each
approach's communication costs, not how it scales across machines.
`--record FILE` puts the `## Across workers` section (tables, cost model, a
CTR model's step on paper from `benchmarks.ctr_cost`, and the run's raw
figures, in an HTML comment) into FILE, replacing the one there, and draws
`<stem>_across_workers.png` beside it; `--redraw` rewrites both from the
figures FILE holds, without running anything.

`--model ctr` runs a CTR model instead (`benchmarks/across_workers_ctr.py`:
embedding tables on ps tasks or all-gathered as slices, five approaches,
examples/sec and bytes a step), into its own section `## Across workers: a
CTR model` and `<stem>_across_workers_ctr.png`; the MLP's are left alone.
"""

import datetime
import os
import sys
import time

from benchmarks import across_workers_cost as probe_cost
from benchmarks import across_workers_report as report
from benchmarks import cli, results_md
from benchmarks import cluster_runs


def main(argv=None):
  parser = make_parser()
  args = parser.parse_args(argv)
  if args.model == "ctr":
    from benchmarks import across_workers_ctr  # pylint: disable=import-outside-toplevel
    return across_workers_ctr.main(parser, args, argv)
  extra = [a for a in args.approaches if a not in cluster_runs.APPROACHES]
  if extra:
    parser.error("argument --approaches: {} run with --model ctr only; "
                 "the MLP's are {}".format(", ".join(extra),
                                           ", ".join(cluster_runs.APPROACHES)))
  if args.redraw:
    if not args.record:
      parser.error("argument --redraw: needs --record FILE, whose figures "
                   "it redraws")
    data = results_md.read_data(results_md.read(args.record),
                                probe_cost.DATA)
    if data is None:
      parser.error("argument --redraw: {} has no across_workers figures; "
                   "record a run first".format(args.record))
    report.publish(args.record, data)
    return 0
  bad = [n for n in args.tasks if args.batch % (n * args.towers)]
  if bad:
    parser.error("argument --batch: must divide evenly over every task "
                 "count's towers (tasks x --towers {}); {} does not for "
                 "--tasks {}".format(args.towers, args.batch, ",".join(
                     str(n) for n in bad)))
  data = measure(args, argv if argv is not None else sys.argv[1:])
  print("\n" + report.section(data))
  if args.record:
    report.publish(args.record, data)
  return 0


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.across_workers",
                      __doc__.splitlines()[0])
  add = parser.add_argument
  tasks = cli.comma_list(cli.whole_number(1), twice=cli.ONCE)
  add("--tasks", metavar="N,N", type=tasks, default="1,2,3",
      help="task counts, the chief included, comma-separated")
  add("--model", choices=("mlp", "ctr"), default="mlp",
      help="the dense MLP, or the CTR model (benchmarks/ctr_model.py), "
      "whose runs have their own section and, for the flags left out: "
      "--tasks 2,3, every approach of {}, --repeats 1, --steps 100, "
      "--warmup 10, --batch 1536, --hidden 256,128, no probe".format(
          ", ".join(cluster_runs.CTR_APPROACHES)))
  add("--approaches",
      metavar="A,A",
      default=",".join(cluster_runs.APPROACHES),
      type=cli.comma_list(cli.one_of(cluster_runs.APPROACHES +
                                     ("hybrid", "ps-async")),
                          twice=cli.ONCE),
      help="which of {} to run (hybrid and ps-async: --model ctr "
      "only)".format(", ".join(cluster_runs.APPROACHES)))
  add("--repeats", metavar="N", type=cli.whole_number(1), default=2,
      help="runs of every (approach, tasks), the order reversed on odd "
      "repeats")
  add("--steps", metavar="N", type=cli.whole_number(1), default=200,
      help="timed global steps a run")
  add("--warmup", metavar="N", type=cli.whole_number(1), default=20,
      help="untimed global steps before them")
  add("--batch", metavar="ROWS", type=cli.whole_number(1), default=384,
      help="the global batch, split evenly over the tasks and their towers")
  add("--hidden", metavar="UNITS,UNITS", default="1024,1024",
      type=cli.comma_list(cli.whole_number(1)),
      help="the MLP's hidden layers (784 inputs, 10 classes)")
  add("--towers", metavar="N", type=cli.whole_number(1), default=2,
      help="towers (virtual CPU devices) a task for replicate and ps-sync")
  add("--fields", metavar="N", type=cli.whole_number(1), default=26,
      help="--model ctr: categorical fields, one embedding table each")
  add("--table-rows", metavar="ROWS", type=cli.whole_number(1),
      default=1048576, help="--model ctr: rows of all the tables together")
  add("--dim", metavar="N", type=cli.whole_number(1), default=16,
      help="--model ctr: the embeddings' width")
  add("--shards", metavar="N", type=cli.whole_number(1), default=2,
      help="--model ctr: partitions of each table "
      "(fixed_size_partitioner)")
  add("--probe-tasks", metavar="N,N", default="2,3",
      type=cli.comma_list(cli.whole_number(2), twice=cli.ONCE),
      help="task counts the collective probe runs at after each repeat")
  add("--probe-rounds", metavar="N", type=cli.whole_number(0), default=200,
      help="timed rounds of the probe; 0 skips it (and the cost model's "
      "measured overhead)")
  add("--timeout", metavar="SECONDS", type=cli.positive_number,
      default=300.0, help="longest a run may take before it is stopped "
      "and counted as failed")
  add("--record", metavar="FILE", default=None,
      help="put the section into FILE (replacing its own) and draw "
      "<stem>_across_workers.png beside it (default: print only)")
  add("--redraw", action="store_true",
      help="rewrite --record's section and plot from the figures it holds; "
      "run nothing")
  return parser


def measure(args, argv):
  """Every run and probe; the figures `section` renders."""
  cells = [(approach, tasks) for approach in args.approaches
           for tasks in args.tasks]
  probes = args.probe_tasks if args.probe_rounds else []
  data = {
      "command": "python -m benchmarks.across_workers " + " ".join(argv),
      "machine": cluster_runs.machine(),
      "date": datetime.date.today().isoformat(),
      "batch": args.batch,
      "hidden": args.hidden,
      "towers": args.towers,
      "steps": args.steps,
      "warmup": args.warmup,
      "repeats": args.repeats,
      "probe_rounds": args.probe_rounds,
      "cells": [list(cell) for cell in cells],
      "runs": {
          cluster_runs.key(*cell): [] for cell in cells
      },  # per repeat, or None
      "failures": {},
      "probes": {
          str(n): [] for n in probes
      },
  }
  total, done, started = args.repeats * (len(cells) + len(probes)), 0, (
      time.monotonic())
  print("{} runs: {} repeats of {} (approach, tasks) runs and {} probes."
        .format(total, args.repeats, len(cells), len(probes)), flush=True)
  for repeat in range(args.repeats):
    for approach, tasks, key in cluster_runs.cells_to_run(data, cells,
                                                          repeat):
      load = os.getloadavg()[0]
      record, error = cluster_runs.run_task_cluster(approach, tasks, args, [
          "--batch", str(args.batch), "--hidden",
          ",".join(str(u) for u in args.hidden), "--towers",
          str(args.towers), "--warmup", str(args.warmup), "--steps",
          str(args.steps)])
      if record:  # the machine's 1-minute load average before and after
        record["load"] = [load, os.getloadavg()[0]]
      done += 1
      if cluster_runs.keep_run(data, key, repeat, record, error):
        print("repeat {} {}: {:,.0f} examples/sec ({:.1f} ms a step, {} "
              "threads){}".format(
                  repeat + 1, key, report.rate(record, args.batch),
                  1000 * record["seconds"] / record["global_steps"],
                  record.get("threads"),
                  cluster_runs.left(started, done, total)),
              flush=True)
    for tasks in probes:
      record, error = cluster_runs.run_task_cluster("probe", tasks, args, [
          "--probe-rounds",
          str(args.probe_rounds), "--probe-elements", ",".join(
              str(s) for s in probe_cost.PROBE_SIZES), "--probe-concurrent",
          str(probe_cost.PROBE_CONCURRENT), "--probe-timeout",
          str(probe_cost.PROBE_TIMEOUT)
      ])
      done += 1
      data["probes"][str(tasks)].append(record)
      print("repeat {} probe, {} tasks: {}{}".format(
          repeat + 1, tasks, error or
          ", ".join("{} {:.2f} ms".format(name, ms)
                    for name, ms in record["median_ms"].items()) +
          ", {} threads".format(record.get("threads")),
          cluster_runs.left(started, done, total)),
            flush=True)
  return data


if __name__ == "__main__":
  sys.exit(main())
