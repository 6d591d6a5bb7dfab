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
import io
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import cli, ctr_cost
from benchmarks import step_cost_model as cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "across_workers_job.py")
APPROACHES = ("replicate", "mwms", "ps-sync")
# With --model ctr: the embeddings on ps (hybrid) and asynchronous ps too.
CTR_APPROACHES = ("replicate", "hybrid", "mwms", "ps-async", "ps-sync")
_PS_MODES = ("hybrid", "ps-async", "ps-sync")
SECTION = "## Across workers"
_DATA = "<!-- across_workers data: "
_PREFIX = "[chief:0] across_workers: "
_PROBE_SIZES = (1, 262144, 2097152)  # float32 elements: 4 B, 1 MiB, 8 MiB
_PROBE_CONCURRENT = 32
# The probe's timed collectives give up after this many seconds. Short:
# TensorFlow 2.15 starts a thread per collective with a timeout that sleeps
# for the whole timeout (tensorflow/tensorflow#62466), and the probe's
# thousands of collectives a second would pile up more threads than a
# process can have.
_PROBE_TIMEOUT = 2.0

# The cost model's assumptions (see step_cost_model and the section's text).
GPU_IMAGES_PER_SECOND = 360.0  # ResNet-50, one V100, float32, batch 64
GPU_BATCH = 64
HOP_LATENCY = 25e-6  # seconds a hop on the cluster's network
CLUSTERS = ((2, 8), (16, 8))  # (machines, GPUs each)
LINKS_GBIT = (25, 100)


def main(argv=None):
  parser = make_parser()
  args = parser.parse_args(argv)
  if args.model == "ctr":
    from benchmarks import across_workers_ctr  # pylint: disable=import-outside-toplevel
    return across_workers_ctr.main(parser, args, argv)
  extra = [a for a in args.approaches if a not in APPROACHES]
  if extra:
    parser.error("argument --approaches: {} run with --model ctr only; "
                 "the MLP's are {}".format(", ".join(extra),
                                           ", ".join(APPROACHES)))
  if args.redraw:
    if not args.record:
      parser.error("argument --redraw: needs --record FILE, whose figures "
                   "it redraws")
    data = read_data(_read(args.record))
    if data is None:
      parser.error("argument --redraw: {} has no across_workers figures; "
                   "record a run first".format(args.record))
    _publish(args.record, data)
    return 0
  bad = [n for n in args.tasks if args.batch % (n * args.towers)]
  if bad:
    parser.error("argument --batch: must divide evenly over every task "
                 "count's towers (tasks x --towers {}); {} does not for "
                 "--tasks {}".format(args.towers, args.batch, ",".join(
                     str(n) for n in bad)))
  data = measure(args, argv if argv is not None else sys.argv[1:])
  print("\n" + section(data))
  if args.record:
    _publish(args.record, data)
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
          ", ".join(CTR_APPROACHES)))
  add("--approaches", metavar="A,A", default=",".join(APPROACHES),
      type=cli.comma_list(cli.one_of(APPROACHES + ("hybrid", "ps-async")),
                          twice=cli.ONCE),
      help="which of {} to run (hybrid and ps-async: --model ctr "
      "only)".format(", ".join(APPROACHES)))
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


# --- measuring ---------------------------------------------------------------


def measure(args, argv):
  """Every run and probe; the figures `section` renders."""
  cells = [(approach, tasks) for approach in args.approaches
           for tasks in args.tasks]
  probes = args.probe_tasks if args.probe_rounds else []
  data = {
      "command": "python -m benchmarks.across_workers " + " ".join(argv),
      "machine": _machine(), "date": datetime.date.today().isoformat(),
      "batch": args.batch, "hidden": args.hidden, "towers": args.towers,
      "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
      "probe_rounds": args.probe_rounds,
      "cells": [list(cell) for cell in cells],
      "runs": {_key(*cell): [] for cell in cells},  # per repeat, or None
      "failures": {},
      "probes": {str(n): [] for n in probes},
  }
  total, done, started = args.repeats * (len(cells) + len(probes)), 0, (
      time.monotonic())
  print("{} runs: {} repeats of {} (approach, tasks) runs and {} probes."
        .format(total, args.repeats, len(cells), len(probes)), flush=True)
  for repeat in range(args.repeats):
    for approach, tasks in (cells if repeat % 2 == 0 else cells[::-1]):
      key = _key(approach, tasks)
      if key in data["failures"]:
        data["runs"][key].append(None)
        continue
      load = os.getloadavg()[0]
      record, error = run_task_cluster(approach, tasks, args, [
          "--batch", str(args.batch), "--hidden",
          ",".join(str(u) for u in args.hidden), "--towers",
          str(args.towers), "--warmup", str(args.warmup), "--steps",
          str(args.steps)])
      if record:  # the machine's 1-minute load average before and after
        record["load"] = [load, os.getloadavg()[0]]
      data["runs"][key].append(record)
      done += 1
      if error:
        data["failures"][key] = error
        print("repeat {} {}: failed: {}".format(repeat + 1, key, error),
              flush=True)
      else:
        print("repeat {} {}: {:,.0f} examples/sec ({:.1f} ms a step, {} "
              "threads){}".format(
                  repeat + 1, key, rate(record, args.batch),
                  1000 * record["seconds"] / record["global_steps"],
                  record.get("threads"), _left(started, done, total)),
              flush=True)
    for tasks in probes:
      record, error = run_task_cluster("probe", tasks, args, [
          "--probe-rounds", str(args.probe_rounds), "--probe-elements",
          ",".join(str(s) for s in _PROBE_SIZES), "--probe-concurrent",
          str(_PROBE_CONCURRENT), "--probe-timeout", str(_PROBE_TIMEOUT)])
      done += 1
      data["probes"][str(tasks)].append(record)
      print("repeat {} probe, {} tasks: {}{}".format(
          repeat + 1, tasks, error or ", ".join(
              "{} {:.2f} ms".format(name, ms) for name, ms in
              record["median_ms"].items()) + ", {} threads".format(
                  record.get("threads")), _left(started, done, total)),
            flush=True)
  return data


def run_task_cluster(mode, tasks, args, job_args):
  """One local cluster run: (the chief's record, None) or (None, error)."""
  from replicate.launch import LocalCluster  # pylint: disable=import-outside-toplevel
  model_dir = tempfile.mkdtemp(prefix="replicate_across_")
  log = io.StringIO()
  command = [sys.executable, JOB, mode, "--model-dir", model_dir] + job_args
  code = None
  try:
    with LocalCluster(command, num_ps=1 if mode in _PS_MODES else 0,
                      num_workers=tasks, env={"PYTHONPATH": ROOT},
                      log=log) as cluster:
      try:
        code = cluster.wait("chief", 0, timeout=args.timeout)
      except TimeoutError:
        pass
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  text = log.getvalue()
  for line in text.splitlines():
    if line.startswith(_PREFIX) and code == 0:
      return json.loads(line[len(_PREFIX):]), None
  with tempfile.NamedTemporaryFile(
      "w", prefix="across_workers_{}_{}_".format(mode, tasks), suffix=".log",
      delete=False) as kept:
    kept.write(text)
  print("The failed run's log: {}".format(kept.name), flush=True)
  return None, failure(text, code, args.timeout)


def failure(log, code, timeout):
  """One line: why a run gave no figure (the last error line its tasks
  logged, with the task), or that it ran out of time."""
  if code is None:
    return "stopped after {:g} s (--timeout)".format(timeout)
  errors = [line for line in log.splitlines()
            if re.search(r"(Error|Exception)\b.*:", line)]
  return ("chief exited with {}: {}".format(code, errors[-1].strip()[:300])
          if errors else "chief exited with {} and no figure".format(code))


def rate(record, batch):
  """Examples/sec of a run: global batch x global steps / seconds."""
  return batch * record["global_steps"] / record["seconds"]


def _key(approach, tasks):
  return "{} x{}".format(approach, tasks)


def _left(started, done, total):
  elapsed = time.monotonic() - started
  return " ({:.0f} s so far, about {:.0f} s left)".format(
      elapsed, elapsed / done * (total - done))


def _machine():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return "{} cores, {}, Python {}, TensorFlow {}, no GPU".format(
      os.cpu_count(), platform.machine(), platform.python_version(),
      tf.__version__)


# --- the section -------------------------------------------------------------


def devices(approach, tasks, towers):
  """Devices that compute: MWMS has one replica a task on CPUs."""
  return tasks * (1 if approach == "mwms" else towers)


def paired(data, key, reference):
  """Per repeat where both ran, rate(key) / rate(reference)."""
  batch = data["batch"]
  return [rate(a, batch) / rate(b, batch)
          for a, b in zip(data["runs"][key], data["runs"][reference])
          if a is not None and b is not None]


def _spread(values, form="{:.2f}"):
  if not values:
    return "-"
  if len(values) == 1:
    return form.format(values[0])
  return (form + " (" + form + "-" + form + ")").format(
      statistics.median(values), min(values), max(values))


def throughput_table(data):
  lines = ["| approach | tasks | devices | rows a device | examples/sec | "
           "step ms | x 1 task | x replicate | chief's threads at the end |",
           "|---|---|---|---|---|---|---|---|---|"]
  for approach, tasks in data["cells"]:
    key = _key(approach, tasks)
    count = devices(approach, tasks, data["towers"])
    head = "| {} | {} | {} | {} |".format(approach, tasks, count,
                                          data["batch"] // count)
    if key in data["failures"]:
      lines.append(head + " failed: {} | - | - | - | - |".format(
          data["failures"][key].replace("|", "/")))
      continue
    runs = [r for r in data["runs"][key] if r is not None]
    one, replicate = _key(approach, 1), _key("replicate", tasks)
    threads = [r["threads"] for r in runs if r.get("threads")]
    lines.append(head + " {} | {} | {} | {} | {} |".format(
        _spread([rate(r, data["batch"]) for r in runs], "{:,.0f}"),
        _spread([1000 * r["seconds"] / r["global_steps"] for r in runs],
                "{:.1f}"),
        _spread(paired(data, key, one)) if tasks != 1 and one in data[
            "runs"] else "-",
        _spread(paired(data, key, replicate)) if approach != "replicate"
        and replicate in data["runs"] else "-",
        _spread(threads, "{:,.0f}")))
  return "\n".join(lines)


def probe_figures(records, concurrent=_PROBE_CONCURRENT):
  """Medians over repeats: ms of each probe fetch, and what follows."""
  records = [r for r in records if r]
  if not records:
    return None
  ms = {name: statistics.median(r["median_ms"][name] for r in records)
        for name in records[0]["median_ms"]}
  tasks = records[0]["tasks"]
  tiny, big = ms[str(_PROBE_SIZES[0])], ms[str(_PROBE_SIZES[-1])]
  moved = cost.ring_bytes_per_member(_PROBE_SIZES[-1] * 4, tasks)
  figures = {"ms": ms, "bandwidth": moved / ((big - tiny) / 1000),
             "repeats": len(records),
             "threads": statistics.median(r.get("threads") or 0
                                          for r in records)}
  for suffix, name in (("", "untimed"), (" timed", "timed")):
    one, many = "1" + suffix, "{}x1{}".format(concurrent, suffix)
    figures[name] = cost.Overhead(
        (ms[one] - ms["none"]) / 1000,
        (ms[many] - ms[one]) / (concurrent - 1) / 1000) if (
            one in ms and many in ms) else None
  return figures


def probe_table(data):
  lines = ["| tasks | empty run ms | 4 B ms | 1 MiB ms | 8 MiB ms | "
           "{n} x 4 B ms | timed: 4 B ms | timed: {n} x 4 B ms | overhead "
           "of one, ms | of each further one, ms | timed: of one, ms | timed: "
           "of each further one, ms | loopback throughput, MB/s | chief's "
           "threads at the end |".format(n=_PROBE_CONCURRENT),
           "|" + "---|" * 14]
  for tasks, records in data["probes"].items():
    figures = probe_figures(records)
    if figures is None:
      lines.append("| {} | failed |".format(tasks) + " - |" * 12)
      continue
    ms = figures["ms"]
    timed = figures["timed"] or cost.Overhead(float("nan"), float("nan"))
    lines.append(
        "| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} | {} | {:.2f} "
        "| {:.2f} | {:.2f} | {:.2f} | {:,.0f} | {:,.0f} |".format(
            tasks, ms["none"], *(ms[str(s)] for s in _PROBE_SIZES),
            ms["{}x1".format(_PROBE_CONCURRENT)],
            *("{:.2f}".format(ms[name]) if name in ms else "-"
              for name in ("1 timed", "{}x1 timed".format(
                  _PROBE_CONCURRENT))),
            1000 * figures["untimed"].first, 1000 * figures["untimed"].more,
            1000 * timed.first, 1000 * timed.more,
            figures["bandwidth"] / 1e6, figures["threads"]))
  return "\n".join(lines).replace("| nan |", "| - |")


def cost_rows(untimed, timed, measured_bandwidth):
  """The cost model's predictions for ResNet-50: one dict per row.

  `timed` (the overhead with an op timeout) is not used: no step's
  collective has one.
  """
  del timed
  shapes, norms = cost.resnet50_shapes()
  gradient_bytes = cost.parameters(shapes) * cost.FLOAT32_BYTES
  collectives = sum(cost.replicate_collectives(shapes, 2 * norms).values())
  compute = GPU_BATCH / GPU_IMAGES_PER_SECOND
  rows = []
  for machines, gpus in CLUSTERS:
    links = [(gbit, gbit * cost.GBIT_BYTES) for gbit in LINKS_GBIT]
    if measured_bandwidth:
      links.append(("loopback here", measured_bandwidth))
    for link, bandwidth in links:
      for arrangement in (cost.flat_ring(machines, gpus, gradient_bytes),
                          cost.replicate_ring(machines, collectives)):
        if link == "loopback here" and arrangement.name != "replicate":
          continue
        # A step's collectives have no op timeout, replicate's (only its
        # start's have one) or a flat ring's.
        overhead = untimed
        timing = cost.step(arrangement, gradient_bytes, bandwidth,
                           HOP_LATENCY, overhead, compute)
        rows.append({"cluster": "{} x {}".format(machines, gpus),
                     "gpus": machines * gpus, "link": link,
                     "arrangement": arrangement, "step": timing,
                     "bytes": cost.ring_bytes_per_member(
                         gradient_bytes, arrangement.members)})
  return rows


def cost_table(rows):
  lines = ["| cluster | link | arrangement | ring members K | MB a link "
           "carries | collectives | transfer ms | latency ms | overhead ms "
           "| step ms, no overlap - full overlap | efficiency, no overlap - "
           "full overlap | images/sec |", "|---|---|---|---|---|---|---|---|"
           "---|---|---|---|"]
  for row in rows:
    step, arrangement = row["step"], row["arrangement"]
    link = row["link"] if isinstance(row["link"], str) else (
        "{} Gb/s".format(row["link"]))
    images = [row["gpus"] * GPU_BATCH / s for s in (step.no_overlap,
                                                     step.overlap)]
    lines.append(
        "| {} | {} | {} | {} | {:.1f} | {} | {:.1f} | {:.2f} | {:.1f} | "
        "{:.0f} - {:.0f} | {:.0%} - {:.0%} | {:,.0f} - {:,.0f} |".format(
            row["cluster"], link, arrangement.name, arrangement.members,
            row["bytes"] / 1e6, arrangement.collectives,
            1000 * step.transfer, 1000 * step.latency, 1000 * step.overhead,
            1000 * step.no_overlap, 1000 * step.overlap,
            step.efficiency_no_overlap, step.efficiency_overlap, *images))
  return "\n".join(lines)


def section(data):
  """The `## Across workers` section of RESULTS.md, from a run's figures."""
  batch, towers = data["batch"], data["towers"]
  hidden = "-".join(str(u) for u in data["hidden"])
  mlp = cost.mlp_shapes(784, data["hidden"], 10)
  mlp_collectives = cost.replicate_collectives(mlp)
  counted = [r["collectives"] for key, runs in data["runs"].items()
             if key.startswith("replicate x") and key != "replicate x1"
             for r in runs if r]
  probe = probe_figures(data["probes"].get("2", []))
  shapes, norms = cost.resnet50_shapes()
  resnet = cost.parameters(shapes)
  resnet_collectives = cost.replicate_collectives(shapes, 2 * norms)
  parts = [
      SECTION, "",
      "`{}`, {}; {}; {}, the order of the runs reversed on odd "
      "repeats.{}".format(data["command"], data["date"], data["machine"],
                          _repeats(data["repeats"]), _load(data)), ""] + [
          line for note in data.get("notes", []) for line in (
              "Note: " + note, "")] + [
      "The same model (MLP 784-{}-10, {:,} float32 parameters, {:.2f} MB of "
      "gradients; plain gradient descent) on the same global batch of {} "
      "rows, split evenly over 1 to {} local tasks, each task its own "
      "process, all on loopback gRPC: `replicate` (`start_server`, "
      "`variable_strategy=\"replicated\"`, {} a task, no ps), "
      "`mwms` (`MultiWorkerMirroredStrategy` through `RunConfig("
      "train_distribute=...)` under `disable_eager_execution()`: one "
      "replica a task, since on CPUs it uses no virtual devices) and "
      "`ps-sync` (1 ps task more, `SyncReplicasOptimizer` in "
      "`TowerOptimizer`, `parameter_server`, {} a task). The chief "
      "times {} global steps after {} untimed ones: examples/sec = "
      "global batch x global steps / seconds, median (min-max) over the "
      "repeats; x 1 task and x replicate are ratios paired within a "
      "repeat. At 1 task nothing crosses processes except ps-sync's "
      "variables, which live on the ps task.".format(
          hidden, cost.parameters(mlp), cost.parameters(mlp) * 4 / 1e6,
          batch, max(t for _, t in data["cells"]), _towers(towers),
          _towers(towers),
          data["steps"], data["warmup"]), "",
      "What 2 shared cores can show: every task, the ps task included, "
      "runs on the same 2 cores, so adding tasks adds no compute, only "
      "processes and messages. On N machines the ideal x 1 task would be "
      "N; here it is 1.0, and what falls short of 1.0 is what each "
      "approach's communication and its extra processes cost on loopback. "
      "How it scales across machines is the cost model's part below.",
      "", throughput_table(data), ""]
  if counted:
    parts += ["Collective ops in the replicate chief's graph: {}; a step "
              "runs {} of them: {}, as the cost model counts them (the "
              "rest run once, at start-up: the model check and the "
              "broadcast of the variables).".format(
                  _counts(counted[0]), sum(mlp_collectives.values()),
                  _described(mlp_collectives)), ""]
  parts += _threads_paragraph(data)
  parts += [
      "### Collectives timed alone", "",
      "Bare cross-process `CollectiveReduceV2` (ring, one CPU device a "
      "task, group leader the chief in each `tf.distribute.Server`'s own "
      "config) between 2 and 3 local task processes, each fetch a "
      "`session.run` of its own, median of {} runs then median over the "
      "repeats, after the training runs of each repeat. Overhead of one: "
      "a 4-byte all-reduce's run less the empty run's. Of each further "
      "one: ({} concurrent 4-byte all-reduces in one run less one alone) "
      "/ {}. Timed: the same with an op timeout ({:g} s here), as "
      "replicate's start has (its step's collectives have none). "
      "Throughput: the bytes a ring member "
      "sends for 8 MiB, 2(K-1)/K x 8 MiB, over (8 MiB run - 4 B "
      "run).".format(data.get("probe_rounds", "-"), _PROBE_CONCURRENT,
                     _PROBE_CONCURRENT - 1, _PROBE_TIMEOUT), "",
      probe_table(data), ""]
  parts += cost_section(probe, resnet, resnet_collectives, norms)
  if probe:
    parts += ["", _loopback_check(data, probe, mlp, mlp_collectives)]
  parts += [""] + ctr_cost.section(probe["untimed"] if probe else None)
  parts += ["", _DATA + json.dumps(data, separators=(",", ":")) + " -->", ""]
  return "\n".join(parts)


def cost_section(probe, resnet, collectives, norms):
  compute_ms = 1000 * GPU_BATCH / GPU_IMAGES_PER_SECOND
  lines = [
      "### A step on a real cluster: the cost model", "",
      "`benchmarks/step_cost_model.py` (its docstring has the model): a "
      "step is each GPU's compute, then a ring all-reduce of the gradients "
      "in which each of K members sends 2(K-1)/K of the bytes S: t_comm = "
      "2(K-1)/K x S / B + rounds x 2(K-1) x latency + overhead(first) + "
      "(collectives - 1) x overhead(further). `flat ring`: every GPU in "
      "the ring (K = all GPUs, Horovod's and NCCL's arrangement; gradients "
      "in 64 MiB fusion buffers, one after the other). `replicate`: each "
      "machine sums its towers first, then one device a machine joins the "
      "ring (K = machines) with one collective per pack of small "
      "gradients, per large gradient, for the batch-norm statistics (one "
      "pack), for the loss, and the rows' all-gather before the step ({} "
      "in all for "
      "ResNet-50: {}), in 2 rounds. Efficiency is compute / step time; "
      "images/sec = GPUs x {} / step time.".format(
          sum(collectives.values()), _described(collectives), GPU_BATCH),
      "",
      "Assumptions: ResNet-50 (v1.5, counted here: {:,} float32 parameters, "
      "S = {:.1f} MB; {} batch-norm layers, so {} statistics); each GPU "
      "computes a batch of {} in {:.1f} ms (the {:.0f} images/sec of one "
      "V100 in float32, an assumption not checked here against a "
      "published table; TensorFlow's published "
      "tf_cnn_benchmarks table of May 2017 gives 219 images/sec on a P100 "
      "at batch 64, which would make communication matter less); backward "
      "is 2/3 of that compute; {:.0f} us a network hop; the bandwidth of "
      "each machine's link as given. No overlap: the all-reduce starts "
      "after the whole backward pass; full overlap: it runs during "
      "backward, so the step is max(compute, forward + t_comm). "
      "TensorFlow runs a collective once its input is ready, so large "
      "gradients can overlap backward, but replicate's pack of small "
      "gradients waits for the last of them (the first layers'), and the "
      "statistics and loss are summed after the forward pass.".format(
          resnet, resnet * 4 / 1e6, norms, 2 * norms, GPU_BATCH, compute_ms,
          GPU_IMAGES_PER_SECOND, HOP_LATENCY * 1e6), ""]
  if not probe:
    lines += ["No probe ran (--probe-rounds 0, or no 2-task probe), so no "
              "overhead was measured and the model's table is left out."]
    return lines
  untimed, timed = probe["untimed"], probe["timed"] or probe["untimed"]
  lines += [
      "Measured here (2 tasks, above): overhead of one collective {:.2f} "
      "ms, of each further one {:.2f} ms, without an op timeout, as both "
      "arrangements' step collectives run ({:.2f} and {:.2f} ms with one, "
      "as only replicate's start runs); loopback throughput {:,.0f} "
      "MB/s. These come from processes sharing 2 busy cores, so they are "
      "likely above what a dedicated machine pays; the `loopback here` "
      "rows show the prediction if TensorFlow's gRPC collectives moved "
      "data no faster than that on the cluster.".format(
          1000 * untimed.first, 1000 * untimed.more, 1000 * timed.first,
          1000 * timed.more, probe["bandwidth"] / 1e6), "",
      cost_table(cost_rows(untimed, timed, probe["bandwidth"])), "",
      "Published, for comparison: Horovod's benchmark page reports 90% "
      "scaling efficiency for Inception V3 and ResNet-101 and 68% for "
      "VGG-16 on 512 Pascal GPUs (128 servers of 4) over 25 Gbit/s RoCE "
      "(https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst); "
      "its paper (Sergeev and Del Balso, arXiv:1802.05799, 2018) reports "
      "about 90% for the same models up to 128 GPUs, ResNet-50 alike "
      "(as the issue for this work quotes it; not re-read here). "
      "TensorFlow's tf_cnn_benchmarks page (tensorflow/docs_src/"
      "performance/benchmarks.md, May 2017, `distributed_replicated`, "
      "8 K80s a server on Amazon EC2, batch 64 a GPU, synthetic data) "
      "gives ResNet-50 378 images/sec on 8 GPUs, 751 on 16 (2 x 8) and "
      "2,744 on 64 (8 x 8) against 52.4 on 1: 90%, 90% and 82% of linear; "
      "on one DGX-1 (8 P100s) 1,734 against 219, 99%. Those slower GPUs "
      "leave more time to hide communication in than the V100 assumed "
      "here. The flat ring's band brackets Horovod's figure; replicate "
      "sends less over each link (K = machines, not GPUs: 1.0 x S at 2 "
      "machines against 1.88 x S), but pays the measured per-collective "
      "overhead on {} collectives a step.".format(
          sum(collectives.values())),
      "",
      "What the model ignores: the sum inside each machine (NVLink or "
      "PCIe, taken as free), contention between rings or streams on one "
      "link, the optimizer's update and the copy back to every tower, the "
      "input pipeline, stragglers and jitter, and TensorFlow's own gRPC "
      "costs beyond the measured overhead (whether its collectives reach "
      "25 or 100 Gb/s is not measured: the `loopback here` rows are the "
      "pessimistic case)."]
  return lines


def _loopback_check(data, probe, mlp, collectives):
  """The model on this machine's own runs: predicted against measured."""
  medians = {}
  for key, runs in data["runs"].items():
    kept = [r for r in runs if r]
    if kept:
      medians[key] = statistics.median(r["seconds"] / r["global_steps"]
                                       for r in kept)
  if "replicate x1" not in medians:
    return ""
  overhead = probe["untimed"]  # the step's collectives have no timeout
  texts = []
  for tasks in sorted(t for a, t in data["cells"] if a == "replicate"
                      and t > 1 and _key(a, t) in medians):
    predicted = cost.step(
        cost.replicate_ring(tasks, sum(collectives.values())),
        cost.parameters(mlp) * 4, probe["bandwidth"], 0.0, overhead,
        0.0).communication
    texts.append("{} tasks: {:.1f} ms predicted, the step {:.1f} ms longer "
                 "than at 1 task".format(
                     tasks, 1000 * predicted,
                     1000 * (medians[_key("replicate", tasks)] -
                             medians["replicate x1"])))
  return ("The model against this machine's own replicate runs (the MLP's "
          "{:.2f} MB, its {} collectives a step, the measured overhead and "
          "throughput; no network latency): {}. The step also grows "
          "because the tasks share the 2 cores and each runs its own "
          "graph, so the prediction is the communication's share of the "
          "growth, not all of it.".format(
              cost.parameters(mlp) * 4 / 1e6, sum(collectives.values()),
              "; ".join(texts)))


def _load(data):
  loads = [value for runs in data["runs"].values() for r in runs
           if r and r.get("load") for value in r["load"]]
  if not loads:
    return ""
  return (" The machine's 1-minute load average was {:.1f} to {:.1f} around "
          "the runs (other jobs shared it).".format(min(loads), max(loads)))


def _towers(count):
  return "{} tower{}".format(count, "" if count == 1 else "s")


def _threads_paragraph(data):
  """What the chiefs' thread counts say, when replicate's run up."""
  threads = {key: statistics.median(r["threads"] for r in runs)
             for key, runs in ((k, [r for r in v if r and r.get("threads")])
                               for k, v in data["runs"].items()) if runs}
  mine = {k: v for k, v in threads.items() if k.startswith("replicate x")
          and k != "replicate x1"}
  if not mine or max(mine.values()) < 1000:
    return []
  others = {k: v for k, v in threads.items() if k.startswith("mwms x")
            and k != "mwms x1"}
  return [
      "Threads: after {} steps the replicate chief has {} threads ({}), "
      "MWMS's {}. TensorFlow 2.15 gives each collective that has an op "
      "timeout a thread of its own that sleeps for the whole timeout "
      "(tensorflow/tensorflow#62466), and every cross-task collective of "
      "replicate has one (`REPLICATE_SYNC_TIMEOUT_SECS`, 120 s by "
      "default), so threads pile up at (collectives a second) x 120 s; "
      "MWMS sets no timeout. Seen on this machine on 2026-11-25, outside "
      "this table: a 2-task replicate run meant to train 2,520 steps (this "
      "job, `--steps 2500`) was killed by SIGABRT after 73 s, both tasks "
      "printing `terminate called after throwing an instance of "
      "'std::system_error' what(): Resource temporarily unavailable`, at "
      "about 15,000 threads a process; with `REPLICATE_SYNC_TIMEOUT_SECS=3` "
      "a 420-step run peaked at about 1,000 threads, with 120 s at 4,300. "
      "The timing runs here are short enough to finish.".format(
          data["warmup"] + data["steps"],
          "-".join("{:,.0f}".format(v) for v in (min(mine.values()),
                                                  max(mine.values()))),
          ", ".join("{} tasks: {:,.0f}".format(k.split("x")[1], v)
                    for k, v in sorted(mine.items())),
          ", ".join("{} at {} tasks".format("{:,.0f}".format(v), k.split(
              "x")[1]) for k, v in sorted(others.items())) or "-"), ""]


def _repeats(count):
  return "1 repeat" if count == 1 else "{} repeats".format(count)


def _counts(counted):
  return ", ".join("{} {}".format(n, kind) for kind, n in counted.items())


def _described(collectives):
  return ", ".join("{} {}".format(n, kind) for kind, n in collectives.items()
                   if n)


# --- RESULTS.md --------------------------------------------------------------


def read_data(text, prefix=_DATA):
  """The figures a recorded section holds, or None (`prefix`: the CTR
  section's, for its own)."""
  start = text.find(prefix)
  if start < 0:
    return None
  end = text.index(" -->", start)
  return json.loads(text[start + len(prefix):end])


def kept_section(text, heading=SECTION):
  """The `## Across workers` section of `text` (to its end or the next
  `## ` heading), or "" if it has none; `heading`: another section's."""
  start = _section_start(text, heading)
  if start < 0:
    return ""
  following = re.search(r"^## ", text[start + len(heading):], re.MULTILINE)
  end = len(text) if not following else (start + len(heading) +
                                         following.start())
  return text[start:end]


def replace_section(text, new, heading=SECTION):
  """`text` with its `## Across workers` section (or `heading`'s) replaced
  by `new` (or `new` appended, after a blank line)."""
  old = kept_section(text, heading)
  if old:  # keeping the blank line before a section that follows
    return text.replace(old, new.rstrip("\n") + (
        "\n\n" if old.endswith("\n\n") else "\n"), 1)
  return text.rstrip("\n") + "\n\n" + new.rstrip("\n") + "\n"


def _section_start(text, heading=SECTION):
  match = re.search(r"^" + re.escape(heading) + r"\s*$", text, re.MULTILINE)
  return match.start() if match else -1


def _read(path):
  try:
    with open(path) as f:
      return f.read()
  except FileNotFoundError:
    return ""


def _publish(path, data):
  publish_section(path, section(data), SECTION, "_across_workers.png",
                  lambda plot_path: draw(plot_path, data),
                  "the across-workers section")


def publish_section(path, text, heading, plot_suffix, draw_plot, what):
  """Writes `text` as `heading`'s section of `path`, and its plot beside
  it (`<stem><plot_suffix>`, by `draw_plot(plot_path)`: False without
  matplotlib); says which, naming the section `what`."""
  whole = _read(path)
  with open(path, "w") as f:
    f.write(replace_section(whole, text, heading))
  plot_path = os.path.splitext(path)[0] + plot_suffix
  if draw_plot(plot_path):
    print("Wrote {} of {} and {}.".format(what, path, plot_path))
  else:
    print("Wrote {} of {}; no plot (matplotlib is not installed).".format(
        what, path))


def draw(path, data):
  """Measured examples/sec by tasks; predicted efficiency. False without
  matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  figure, (left, right) = pyplot.subplots(1, 2, figsize=(13, 5.2),
                                          layout="constrained")
  colors = {"replicate": "tab:green", "mwms": "tab:blue",
            "ps-sync": "tab:orange"}
  for approach in [a for a in APPROACHES
                   if any(c[0] == a for c in data["cells"])]:
    points = []
    for cell in data["cells"]:
      runs = [r for r in data["runs"][_key(*cell)] if r]
      if cell[0] == approach and runs:
        rates = [rate(r, data["batch"]) for r in runs]
        points.append((cell[1], statistics.median(rates), min(rates),
                       max(rates)))
    if points:
      tasks, medians, lows, highs = zip(*sorted(points))
      left.errorbar(tasks, medians, yerr=[[m - l for m, l in zip(
          medians, lows)], [h - m for m, h in zip(medians, highs)]],
                    marker="o", capsize=4, color=colors[approach],
                    label=approach)
  left.set_xticks(sorted({c[1] for c in data["cells"]}))
  left.set_xlabel("local tasks (processes), global batch {} split evenly"
                  .format(data["batch"]))
  left.set_ylabel("examples/sec (median, min-max bars)")
  left.set_ylim(bottom=0)
  left.grid(True, color="0.9")
  left.legend()
  left.set_title("Measured: MLP 784-{}-10 on 2 shared cores, loopback gRPC"
                 .format("-".join(str(u) for u in data["hidden"])),
                 fontsize=10)
  probe = probe_figures(data["probes"].get("2", []))
  if probe:
    rows = cost_rows(probe["untimed"], probe["timed"], probe["bandwidth"])
    labels = ["{}, {}\n{}".format(
        r["cluster"], r["link"] if isinstance(r["link"], str) else
        "{} Gb/s".format(r["link"]), r["arrangement"].name) for r in rows]
    low = [r["step"].efficiency_no_overlap for r in rows]
    high = [r["step"].efficiency_overlap for r in rows]
    positions = range(len(rows))
    right.bar(positions, low, color=["tab:purple" if r[
        "arrangement"].name == "flat ring" else "tab:green" for r in rows],
              label="no overlap")
    right.bar(positions, [h - l for h, l in zip(high, low)], bottom=low,
              color="0.85", label="gain with full overlap")
    right.axhline(0.9, color="black", linestyle=":", linewidth=1,
                  label="90%: Horovod's and tf_cnn_benchmarks' published "
                  "figures")
    right.set_xticks(list(positions), labels, fontsize=7, rotation=90)
    right.set_ylim(0, 1.3)
    right.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0])
    right.set_ylabel("predicted scaling efficiency")
    right.legend(fontsize=8, loc="upper center", ncol=2)
    right.set_title("Cost model: ResNet-50, {:.0f} images/sec a GPU "
                    "(purple: flat ring, green: replicate)".format(
                        GPU_IMAGES_PER_SECOND), fontsize=10)
  else:
    right.set_visible(False)
  figure.suptitle("Synchronous training across workers\n{}; {}, {}".format(
      data["machine"], data["date"], _repeats(data["repeats"])),
                  fontsize=11)
  figure.savefig(path, dpi=100)
  pyplot.close(figure)
  return True


if __name__ == "__main__":
  sys.exit(main())
