"""The local clusters the across-workers benchmarks run, and their records.

One run is one `replicate.launch.LocalCluster` of `benchmarks/across_workers_job.py`
tasks (one process a task, loopback gRPC); the chief prints one JSON record,
which `run_task_cluster` returns. Shared by the MLP's runs
(`benchmarks.across_workers`) and the CTR model's
(`benchmarks.across_workers_ctr`), with the small helpers both sections use.
"""

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "across_workers_job.py")
APPROACHES = ("replicate", "mwms", "ps-sync")
# With --model ctr: the embeddings on ps (hybrid) and asynchronous ps too.
CTR_APPROACHES = ("replicate", "hybrid", "mwms", "ps-async", "ps-sync")
PS_MODES = ("hybrid", "ps-async", "ps-sync")
PREFIX = "[chief:0] across_workers: "


def run_task_cluster(mode, tasks, args, job_args):
  """One local cluster run: (the chief's record, None) or (None, error)."""
  from replicate.launch import LocalCluster  # pylint: disable=import-outside-toplevel
  model_dir = tempfile.mkdtemp(prefix="replicate_across_")
  log = io.StringIO()
  command = [sys.executable, JOB, mode, "--model-dir", model_dir] + job_args
  code = None
  try:
    with LocalCluster(command, num_ps=1 if mode in PS_MODES else 0,
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
    if line.startswith(PREFIX) and code == 0:
      return json.loads(line[len(PREFIX):]), None
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


def key(approach, tasks):
  """A run's name in the records: "replicate x2"."""
  return "{} x{}".format(approach, tasks)


def left(started, done, total):
  """The progress line's time so far and time left."""
  elapsed = time.monotonic() - started
  return " ({:.0f} s so far, about {:.0f} s left)".format(
      elapsed, elapsed / done * (total - done))


def machine():
  """This machine, as a section's first line names it."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return "{} cores, {}, Python {}, TensorFlow {}, no GPU".format(
      os.cpu_count(), platform.machine(), platform.python_version(),
      tf.__version__)


def spread(values, form="{:.2f}"):
  """median (min-max) of `values`, or the one value, or "-"."""
  if not values:
    return "-"
  if len(values) == 1:
    return form.format(values[0])
  return (form + " (" + form + "-" + form + ")").format(
      statistics.median(values), min(values), max(values))


def repeats(count):
  """"1 repeat", "2 repeats"."""
  return "1 repeat" if count == 1 else "{} repeats".format(count)


def load_note(data):
  """The sentence giving the load average around the runs, or ""."""
  loads = [value for runs in data["runs"].values() for r in runs
           if r and r.get("load") for value in r["load"]]
  if not loads:
    return ""
  return (" The machine's 1-minute load average was {:.1f} to {:.1f} around "
          "the runs (other jobs shared it).".format(min(loads), max(loads)))


def keep_run(data, key, repeat, record, error):
  """Keeps a run's record (None if it failed) in `data`, and a failure's
  reason, which it prints; whether the run gave a record."""
  data["runs"][key].append(record)
  if error:
    data["failures"][key] = error
    print("repeat {} {}: failed: {}".format(repeat + 1, key, error),
          flush=True)
  return not error


def cells_to_run(data, cells, repeat):
  """(approach, tasks, key) of each cell `repeat` runs, in reverse order on
  odd repeats; a cell that failed before is not run again (None in its
  runs for this repeat)."""
  for approach, tasks in (cells if repeat % 2 == 0 else cells[::-1]):
    name = key(approach, tasks)
    if name in data["failures"]:
      data["runs"][name].append(None)
      continue
    yield approach, tasks, name
