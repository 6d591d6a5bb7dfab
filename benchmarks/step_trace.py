"""python -m benchmarks.step_trace: where one step of across_workers goes.

    python -m benchmarks.step_trace replicate --tasks 2 [--towers 1]
    python -m benchmarks.step_trace mwms --tasks 3 --traced 0 --steps 200

Runs `benchmarks/across_workers_job.py`'s training (the same MLP, batch and
flags) on a local cluster, with one more hook on every task. The chief
first prints the collectives in its graph, each with the collectives and
Python ops it waits for (data and control inputs), then, after `--warmup`
steps, traces `--traced` steps with `RunOptions(trace_level=FULL_TRACE)`
and prints, per traced step, the ops run, each collective's, Python op's
and input op's start and end in ms from the step's first op, the op types
run most and the op types that took the most time; `--timeline DIR` also
writes each traced step as a Chrome trace (chrome://tracing). Then every
task times `--steps` untraced steps: ms of wall clock and of its process's
CPU time a step. On 2 shared cores the CPU a step is what decides the
throughput of 2-3 tasks, and it moves less than the wall clock when other
jobs load the machine. A traced step is slower than an untraced one:
compare modes, not figures with RESULTS.md.
"""

import argparse
import collections
import io
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PREFIX = "[chief:0] step_trace: "


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=("replicate", "mwms"))
  parser.add_argument("--tasks", type=int, default=2)
  parser.add_argument("--towers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=384)
  parser.add_argument("--warmup", type=int, default=30)
  parser.add_argument("--traced", type=int, default=5)
  parser.add_argument("--steps", type=int, default=100,
                      help="steps timed (wall and CPU) after the traced")
  parser.add_argument("--timeline", default=None)
  parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
  args, rest = parser.parse_known_args(argv)
  if args.job:
    return _job(args, rest)
  from replicate.launch import LocalCluster  # pylint: disable=import-outside-toplevel
  model_dir = tempfile.mkdtemp(prefix="replicate_trace_")
  log = io.StringIO()
  command = [sys.executable, os.path.abspath(__file__), args.mode, "--job",
             "--traced", str(args.traced), "--timeline",
             args.timeline or "", "--model-dir", model_dir, "--batch",
             str(args.batch), "--towers", str(args.towers), "--warmup",
             str(args.warmup), "--steps", str(args.steps)]
  try:
    with LocalCluster(command, num_workers=args.tasks,
                      env={"PYTHONPATH": ROOT}, log=log) as cluster:
      code = cluster.wait("chief", 0, timeout=300)
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  lines = [line[len("[chief:0] "):] if line.startswith(_PREFIX) else line
           for line in log.getvalue().splitlines()
           if "] step_trace: " in line]
  if code != 0 or not lines:
    print(log.getvalue()[-5000:])
    return 1
  print("\n".join(lines))
  return 0


def _job(args, rest):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import across_workers_job as job  # pylint: disable=import-outside-toplevel
  from benchmarks import job_timer  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.python.client import timeline  # pylint: disable=import-outside-toplevel

  def say(text):
    for line in text.splitlines():
      print("step_trace: " + line, flush=True)

  class Traced(job_timer.Timer):

    def __init__(self, warmup, traced=None):
      # `traced`: the steps whose bytes the CTR runs count; none here.
      super().__init__(warmup, traced)
      self._runs = 0
      self._traced_runs = 0
      self._clock = None  # (wall, process CPU, run) after the traced

    def begin(self):
      super().begin()
      if json.loads(os.environ["TF_CONFIG"])["task"]["type"] != "chief":
        self._traced_runs = args.traced  # only the chief traces
        return
      graph = tf.compat.v1.get_default_graph()
      ops = [op for op in graph.get_operations()
             if op.type.startswith("Collective")]
      say("{} mode, collectives in the chief's graph:".format(args.mode))
      for op in ops:
        waits = _behind(op, lambda o: o.type.startswith("Collective") or
                        o.type in ("PyFunc", "PyFuncStateless",
                                   "EagerPyFunc"), via_control=True)
        say("  {} {} {} on {}; waits for: {}".format(
            op.type, op.name, op.inputs[0].shape if op.inputs else "",
            op.device, ", ".join(sorted(o.name for o in waits)) or "-"))

    def before_run(self, run_context):
      fetches = super().before_run(run_context).fetches
      self._runs += 1
      if self._runs > args.warmup and self._traced_runs < args.traced:
        return tf.compat.v1.train.SessionRunArgs(
            fetches, options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
      return tf.compat.v1.train.SessionRunArgs(fetches)

    def after_run(self, run_context, run_values):
      super().after_run(run_context, run_values)
      if self._runs == args.warmup + args.traced + 1:
        self._clock = (time.perf_counter(), time.process_time(), self._runs)
      elif (self._runs == args.warmup + args.traced + 1 + args.steps and
            self._clock):
        wall, cpu, runs = self._clock
        steps = self._runs - runs
        say("{}: {} steps: {:.2f} ms wall, {:.2f} ms CPU a step".format(
            _task_name(), steps,
            1000 * (time.perf_counter() - wall) / steps,
            1000 * (time.process_time() - cpu) / steps))
      metadata = run_values.run_metadata
      if metadata is None or not metadata.step_stats.dev_stats:
        return
      self._traced_runs += 1
      say(_summary(metadata.step_stats, self._traced_runs))
      if args.timeline:
        os.makedirs(args.timeline, exist_ok=True)
        with open(os.path.join(args.timeline, "{}_{}_{}.json".format(
            args.mode, args.tasks_in_cluster, self._traced_runs)), "w") as f:
          f.write(timeline.Timeline(metadata.step_stats)
                  .generate_chrome_trace_format())

  tf_config = json.loads(os.environ["TF_CONFIG"])
  args.tasks_in_cluster = 1 + len(tf_config["cluster"].get("worker", []))
  return job.main([args.mode] + rest + [
      "--batch", str(args.batch), "--towers", str(args.towers),
      "--warmup", str(args.warmup), "--steps",
      str(args.traced + args.steps + 5)], timer_class=Traced)


def _task_name():
  task = json.loads(os.environ["TF_CONFIG"])["task"]
  return "{}:{}".format(task["type"], task["index"])


def _behind(op, wanted, via_control):
  """The ops `wanted` picks that `op` waits for, not looking past them."""
  seen, found, stack = set(), set(), list(op.inputs) + list(
      op.control_inputs if via_control else [])
  while stack:
    item = stack.pop()
    node = getattr(item, "op", item)
    if node in seen:
      continue
    seen.add(node)
    if wanted(node):
      found.add(node)
      continue
    stack.extend(t for t in node.inputs)
    stack.extend(node.control_inputs)
  return found


def _summary(step_stats, index):
  nodes = [(dev.device, node) for dev in step_stats.dev_stats
           for node in dev.node_stats]
  start = min(n.all_start_micros for _, n in nodes)
  end = max(n.all_start_micros + n.all_end_rel_micros for _, n in nodes)
  lines = ["traced step {}: {:.1f} ms from first op to last, {} ops".format(
      index, (end - start) / 1000, len(nodes))]
  seen = set()
  for device, node in sorted(nodes, key=lambda x: x[1].all_start_micros):
    label = node.timeline_label
    kind = label.split(" = ")[1].split("(")[0] if " = " in label else ""
    if ("Collective" in kind or "PyFunc" in kind or "Iterator" in kind or
        "Optional" in kind) and node.node_name not in seen:
      seen.add(node.node_name)
      lines.append("  {:7.2f} - {:7.2f} ms  {} {} [{}]".format(
          (node.all_start_micros - start) / 1000,
          (node.all_start_micros + node.all_end_rel_micros - start) / 1000,
          kind, node.node_name, device.split("/")[-1]))
  counts = collections.Counter(
      node.timeline_label.split(" = ")[1].split("(")[0]
      if " = " in node.timeline_label else node.node_name
      for _, node in nodes)
  lines.append("  most run: " + ", ".join(
      "{} {}".format(k, v) for k, v in counts.most_common(25)))
  by_type = collections.Counter()
  for _, node in nodes:
    label = node.timeline_label
    kind = label.split(" = ")[1].split("(")[0] if " = " in label else (
        node.node_name)
    by_type[kind] += node.op_end_rel_micros - node.op_start_rel_micros
  lines.append("  busiest: " + ", ".join("{} {:.1f}".format(k, v / 1000)
                                         for k, v in by_type.most_common(14)))
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
