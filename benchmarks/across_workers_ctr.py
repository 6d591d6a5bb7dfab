"""python -m benchmarks.across_workers --model ctr: a CTR model across tasks.

The CTR model of `benchmarks/ctr_model.py` (26 int64 fields, embedding
tables of 1M rows x 16 in all, each partitioned, an MLP on top, Adagrad) on
the same global batch split over 2 and 3 local tasks, five ways:

- `replicate`: the synchronous cluster (`start_server`,
  `variable_strategy="replicated"`, no ps), whose sparse gradients cross
  tasks as all-gathered slices;
- `hybrid`: the same with one ps task, on which the partitioned variables
  (the tables) live; everything else replicated and all-reduced;
- `mwms`: `MultiWorkerMirroredStrategy` (one replica a task; it ignores
  the partitioner and all-gathers the tables' `IndexedSlices`);
- `ps-async`: one ps task, `variable_strategy="parameter_server"`, every
  task updating on its own;
- `ps-sync`: the same with `SyncReplicasOptimizer`.

Each run also reports the bytes that crossed between tasks in two traced
warm-up steps of the chief (a quarter of its batch, then all of it; see
`ctr_model.step_bytes`). `--record FILE` puts the section `## Across
workers: a CTR model` into FILE and draws `<stem>_across_workers_ctr.png`
beside it; the MLP's `## Across workers` section is left as it is.
"""

import datetime
import os
import sys
import time

from benchmarks import across_workers_ctr_report as report
from benchmarks import cluster_runs, results_md

# The CTR runs' defaults, where the command line leaves a flag out.
DEFAULTS = {"tasks": [2, 3], "approaches": list(cluster_runs.CTR_APPROACHES),
            "repeats": 1, "steps": 100, "warmup": 10, "batch": 1536,
            "hidden": [256, 128], "probe_rounds": 0}
_FLAGS = {"tasks": "--tasks", "approaches": "--approaches",
          "repeats": "--repeats", "steps": "--steps", "warmup": "--warmup",
          "batch": "--batch", "hidden": "--hidden",
          "probe_rounds": "--probe-rounds"}
_TRACED_LAST = 6  # the job's last traced local step (TRACED_STEPS)


def main(parser, args, argv):
  """`across_workers.main` with --model ctr."""
  argv = list(argv if argv is not None else sys.argv[1:])
  with_defaults(args, argv)
  if args.redraw:
    if not args.record:
      parser.error("argument --redraw: needs --record FILE, whose figures "
                   "it redraws")
    data = results_md.read_data(results_md.read(args.record), report.DATA)
    if data is None:
      parser.error("argument --redraw: {} has no CTR across_workers "
                   "figures; record a run first".format(args.record))
    report.publish(args.record, data)
    return 0
  bad = [n for n in args.tasks if args.batch % (4 * n * args.towers)]
  if bad:
    parser.error("argument --batch: with --model ctr, a quarter of each "
                 "task's rows must divide evenly over its towers (4 x tasks "
                 "x --towers {}); {} does not for --tasks {}".format(
                     args.towers, args.batch,
                     ",".join(str(n) for n in bad)))
  if args.warmup <= _TRACED_LAST + 1:
    parser.error("argument --warmup: with --model ctr, must be above {} "
                 "(the traced steps are warm-up steps); received {}".format(
                     _TRACED_LAST + 1, args.warmup))
  data = measure(args, "python -m benchmarks.across_workers " +
                 " ".join(argv))
  print("\n" + report.section(data))
  if args.record:
    report.publish(args.record, data)
  return 0


def with_defaults(args, argv):
  """Sets DEFAULTS on `args` for each flag `argv` leaves out."""
  given = {word.split("=")[0] for word in argv if word.startswith("--")}
  for name, value in DEFAULTS.items():
    if _FLAGS[name] not in given:
      setattr(args, name, list(value) if isinstance(value, list) else value)
  return args


def measure(args, command):
  cells = [(a, t) for a in args.approaches for t in args.tasks]
  data = {
      "command": command, "machine": cluster_runs.machine(),
      "date": datetime.date.today().isoformat(), "batch": args.batch,
      "hidden": args.hidden, "towers": args.towers, "steps": args.steps,
      "warmup": args.warmup, "repeats": args.repeats, "fields": args.fields,
      "table_rows": args.table_rows, "dim": args.dim, "shards": args.shards,
      "cells": [list(cell) for cell in cells],
      "runs": {cluster_runs.key(*cell): [] for cell in cells}, "failures": {}}
  job_args = ["--model", "ctr", "--batch", str(args.batch), "--hidden",
              ",".join(str(u) for u in args.hidden), "--towers",
              str(args.towers), "--warmup", str(args.warmup), "--steps",
              str(args.steps), "--fields", str(args.fields), "--table-rows",
              str(args.table_rows), "--dim", str(args.dim), "--shards",
              str(args.shards)]
  total, done, started = args.repeats * len(cells), 0, (
      time.monotonic())
  print("{} runs: {} repeats of {} (approach, tasks) runs.".format(
      total, args.repeats, len(cells)), flush=True)
  for repeat in range(args.repeats):
    for approach, tasks, key in cluster_runs.cells_to_run(data, cells,
                                                          repeat):
      load, begun = os.getloadavg()[0], time.monotonic()
      record, error = cluster_runs.run_task_cluster(approach, tasks, args,
                                                    job_args)
      if record:  # the load average around it; the run's wall time
        record["load"] = [load, os.getloadavg()[0]]
        record["wall"] = time.monotonic() - begun
      done += 1
      if cluster_runs.keep_run(data, key, repeat, record, error):
        print("repeat {} {}: {:,.0f} examples/sec, {} bytes a step{}".format(
            repeat + 1, key, report.rate(record, approach, args.batch),
            _bytes_text(record), cluster_runs.left(started, done, total)),
              flush=True)
  return data


def _bytes_text(record):
  return ", ".join("{} {:,}".format(name, report.total(figures))
                   for name, figures in sorted(record.get("bytes", {}).items()))
