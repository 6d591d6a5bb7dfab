"""A local launcher for trying a TensorFlow gRPC cluster on one machine.

Every task (`chief:0`, `worker:i`, `ps:i`, optionally `evaluator:0`) runs the
same command with its own `TF_CONFIG`, which is what the Estimator's
`RunConfig` reads to know its cluster and its part in it. Without `--ps`,
the cluster is the chief and workers only, which train in lockstep when the
program calls `replicate.start_server` (a synchronous cluster); with
`--ps N`, N ps tasks hold the embeddings of a synchronous cluster
(`variable_strategy="replicated"`), or, with `--asynchronous`, the
variables of the Estimator's ps training, each worker on its own:
```
python -m replicate.launch --workers 2 -- python train.py --steps 100
python -m replicate.launch --ps 2 --workers 2 -- python train.py --steps 100
python -m replicate.launch --ps 1 --workers 2 --asynchronous -- \
    python train.py --steps 100
```
or from Python:
```python
with LocalCluster(["python", "train.py"], num_ps=0, num_workers=2) as cluster:
  exit_code = cluster.wait_for_chief(grace=30)
```

On ports: each task in the cluster spec gets a free port on 127.0.0.1, found
by binding port 0. All are held open until all are picked, so no two tasks
share one; another program can still take one before its task binds it.
TensorFlow's server then listens on that port on every interface, not only
127.0.0.1: run this on a machine whose firewall keeps those ports private.

On logs: each task's stdout and stderr go, line by line, to the launcher's
stdout as `[worker:0] ...`; the launcher's own lines start with `[launch]`.
Tasks get `PYTHONUNBUFFERED=1` (unless set already) so lines show as printed.

On stopping: when the chief exits, the workers and the evaluator get `grace`
seconds to exit on their own, then everything left is stopped; the ps tasks
never exit by themselves (they serve until stopped: on a real cluster, the
cluster manager stops them when the chief is done). A task is stopped with
SIGTERM to its process group (its children too), then SIGKILL a few seconds
later. Ctrl-C or SIGTERM to the launcher stops all.

On failures: by default the cluster is synchronous (every training task
waits for the others at every step, with or without ps tasks), so the first
task that fails (exits non-zero, or is killed) ends it: the launcher prints
which task failed, how, and its last error line, stops every other task at
once, and exits with that task's code. With `asynchronous=True`
(`--asynchronous`, for ps training the Estimator's way, where each worker
steps on its own), a worker that fails is reported and the others go on
without it; the chief's exit still ends the run, and a ps task's failure
stops every task (nobody here restarts it, and the workers cannot step
without it). An evaluator is outside the cluster: its failure is reported,
and training goes on.
The launcher exits with the chief's exit code, or the failed task's (128 + N
if it died of signal N; 130 on Ctrl-C, 143 on SIGTERM). Logging, stopping
and signals at the level of processes are `replicate.cluster.processes`;
this module is the cluster.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence, TextIO, Tuple

# Checks the install (see replicate._identity) and imports no TensorFlow:
# the launcher needs none, so `--help` answers at once.
from replicate import _identity  # noqa: F401  pylint: disable=unused-import
from replicate.cluster import processes

Task = Tuple[str, int]

_POLL_SECONDS = 0.1


class LocalCluster:
  """Runs `command` once per task of a local cluster, each with its TF_CONFIG.

  `num_workers` counts the chief. With `num_ps=0` (the default) the cluster
  is the chief and workers only; with ps tasks, the `command` trains
  synchronously too (`replicate.start_server` and
  `variable_strategy="replicated"`) unless `asynchronous` says it trains
  the Estimator's way, each worker on its own: that decides whether a
  failed worker ends the run (see the module's docstring). `env` is merged over `os.environ` for every
  task. `log` (default `sys.stdout`) receives every task's prefixed lines.
  Entering the `with` block starts the tasks; leaving it stops them.
  """

  def __init__(self, command: Sequence[str], num_ps: int = 0,
               num_workers: int = 2, evaluator: bool = False,
               env: Optional[Dict[str, str]] = None,
               log: Optional[TextIO] = None, asynchronous: bool = False):
    if isinstance(command, str) or not command:
      raise ValueError(
          "command must be a non-empty list of strings, such as "
          "['python', 'train.py']. Received: {!r}.".format(command))
    if num_workers < 1:
      raise ValueError("num_workers counts the chief, so it must be at least "
                       "1. Received: {!r}.".format(num_workers))
    if num_ps < 0:
      raise ValueError("num_ps must be 0 or more. Received: {!r}.".format(
          num_ps))
    if asynchronous and not num_ps:
      raise ValueError(
          "asynchronous=True is training on ps tasks, each worker on its "
          "own, so it needs num_ps of at least 1; a cluster of the chief and "
          "workers only is synchronous. Pass num_ps, or drop asynchronous.")
    self._asynchronous = asynchronous
    self._command = list(command)
    self._env = dict(env or {})
    self._log = processes.Log(log if log is not None else sys.stdout)
    self._cluster = _cluster_spec(num_ps, num_workers)
    self._tasks = [(job, index) for job, addresses in self._cluster.items()
                   for index in range(len(addresses))]
    if evaluator:
      self._tasks.append(("evaluator", 0))
    self._processes: Dict[Task, subprocess.Popen] = {}
    self._readers: Dict[Task, threading.Thread] = {}
    self._tails: Dict[Task, processes.Tail] = {}

  def __enter__(self) -> "LocalCluster":
    try:
      self.start()
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exception_info) -> None:
    self.stop()

  def start(self) -> None:
    """Starts every task, ps first; does nothing if already started.

    Logs one `[launch]` line first: the tasks, their ports and the command.
    """
    if self._processes:
      return
    self._log.line("launch", self.describe())
    for task in sorted(self._tasks, key=lambda task: task[0] != "ps"):
      self._start_task(task)

  def describe(self) -> str:
    """One line: how many tasks of each kind, their ports, the command.

    The command is quoted as a shell would need it, a newline shown as \\n.
    """
    counts = {job: sum(task[0] == job for task in self._tasks)
              for job in ("chief", "worker", "ps", "evaluator")}
    words = ["{} {}{}".format(count, job, "s" if job == "worker" and
                              count > 1 else "")
             for job, count in counts.items() if count]
    ports = ", ".join(
        "{}:{} port {}".format(job, index, address.rsplit(":", 1)[1])
        for job, addresses in self._cluster.items()
        for index, address in enumerate(addresses))
    return ("Starting {} on 127.0.0.1 ({}{}); every task runs: {}".format(
        _and(words), ports,
        "; the evaluator is outside the cluster spec" if counts["evaluator"]
        else "",
        shlex.join(self._command).replace("\n", "\\n")))

  def tf_config(self, task_type: str, index: int) -> dict:
    """The TF_CONFIG dict that task `task_type:index` runs with."""
    self._check_task(task_type, index)
    return {"cluster": {job: list(addresses)
                        for job, addresses in self._cluster.items()},
            "task": {"type": task_type, "index": index},
            "environment": "cloud"}

  def process(self, task_type: str, index: int) -> subprocess.Popen:
    """The task's current process (its latest one after a restart)."""
    self._check_task(task_type, index)
    if (task_type, index) not in self._processes:
      raise RuntimeError("Task {}:{} has not been started; call start() "
                         "first.".format(task_type, index))
    return self._processes[(task_type, index)]

  def kill(self, task_type: str, index: int,
           sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to the task and its children; no-op if it has exited."""
    processes.signal_group(self.process(task_type, index), sig)

  def restart(self, task_type: str, index: int) -> None:
    """Stops the task if it still runs, then starts it with the same ports."""
    processes.stop_processes([self.process(task_type, index)], timeout=5.0)
    self._readers[(task_type, index)].join(timeout=1.0)
    self._start_task((task_type, index))

  def wait(self, task_type: str, index: int, timeout: float) -> int:
    """Waits for the task to exit and its output to be logged; its code."""
    process = self.process(task_type, index)
    try:
      returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      raise TimeoutError(
          "Task {}:{} (pid {}) was still running after {} s. Wait longer, or "
          "kill() it.".format(task_type, index, process.pid, timeout)) from None
    self._readers[(task_type, index)].join(timeout=1.0)
    return returncode

  def wait_for_chief(self, grace: float = 30.0) -> int:
    """Waits for the chief, gives the others `grace` s, stops the rest.

    Returns the chief's exit code. A task that fails first is reported
    (with its last error line); in a synchronous cluster (the default), or
    for a ps task, its failure stops every task at once and its code is
    returned instead.
    """
    # The chief's exit is this loop's to see: one between the wait's
    # time-out and the report would otherwise be taken for a failure that
    # ends the cluster, asynchronous or not.
    reported = {("chief", 0)}
    while True:
      failed = self._report_failures(reported)
      if failed is not None:
        self.stop()
        return self.process(*failed).returncode
      try:
        chief_code = self.wait("chief", 0, timeout=_POLL_SECONDS)
        break
      except TimeoutError:
        pass
    if chief_code and not self._asynchronous:
      # A chief that fails ends a synchronous cluster as any task does.
      reported.discard(("chief", 0))
      self._report_failures(reported)
      self.stop()
      return chief_code
    self._log.line("launch", "chief:0 {}; waiting up to {} s for the workers "
                   "and evaluator.".format(processes.describe(chief_code),
                                           grace))
    deadline = time.monotonic() + grace
    for task in self._tasks:
      if task[0] in ("worker", "evaluator"):
        with contextlib.suppress(TimeoutError):
          self.wait(*task, timeout=max(0.0, deadline - time.monotonic()))
    self._report_failures(reported)
    self.stop()
    return chief_code

  def stop(self, timeout: float = 5.0) -> None:
    """Stops every task still running: SIGTERM, then SIGKILL after `timeout`."""
    processes.stop_processes(list(self._processes.values()), timeout)
    for reader in self._readers.values():
      reader.join(timeout=1.0)

  def _check_task(self, task_type, index):
    if (task_type, index) not in self._tasks:
      raise ValueError("This cluster has no task {}:{}; its tasks are {}."
                       .format(task_type, index, ", ".join(
                           "{}:{}".format(*task) for task in self._tasks)))

  def _start_task(self, task):
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(self._env)
    env["TF_CONFIG"] = json.dumps(self.tf_config(*task))
    # Own session: a signal to the task reaches its children, and the
    # terminal's Ctrl-C reaches only the launcher, which then stops all.
    process = subprocess.Popen(
        self._command, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    self._processes[task] = process
    self._tails[task] = processes.Tail()
    reader = threading.Thread(target=processes.stream_lines, daemon=True,
                              args=(process.stdout, "{}:{}".format(*task),
                                    self._log, self._tails[task]))
    reader.start()
    self._readers[task] = reader

  def _report_failures(self, reported) -> Optional[Task]:
    """Reports each task that failed since; the first whose failure ends
    the run (see the module's docstring), or None."""
    ending = None
    for task, process in self._processes.items():
      if task in reported or process.poll() in (None, 0):
        continue
      reported.add(task)
      # Its last lines are read before they are described.
      self._readers[task].join(timeout=1.0)
      ends = (task[0] == "ps" or not (
          task[0] == "evaluator" or
          (self._asynchronous and task[0] == "worker")))
      if ends:
        outcome = ("stopping every task: {} cannot go on without it".format(
            "training" if task[0] == "ps" and self._asynchronous else
            "the synchronous cluster"))
      else:
        outcome = ("the others go on without it" if task[0] == "evaluator"
                   else "the others go on without it (asynchronous)")
      self._log.line("launch", "{}:{} {} ({}); {}.".format(
          task[0], task[1], processes.describe(process.returncode),
          self._tails[task].last_error(), outcome))
      if ends and ending is None:
        ending = task
    return ending


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command line; returns the chief's exit code, or the code of
  the task whose failure ended the run (130 on Ctrl-C)."""
  arguments = _parse_arguments(argv)
  cluster = LocalCluster(arguments.command, num_ps=arguments.ps,
                         num_workers=arguments.workers,
                         evaluator=arguments.evaluator,
                         asynchronous=arguments.asynchronous)
  with processes.signals_raise_interrupted():
    try:
      with cluster:
        chief_code = cluster.wait_for_chief(arguments.grace)
    except processes.Interrupted as interrupted:
      # The signal may have cut a stop short; further ones are ignored now.
      cluster.stop()
      return 128 + interrupted.args[0]
  # A shell reports death by signal N as 128 + N; a negative code would wrap.
  return chief_code if chief_code >= 0 else 128 - chief_code


def _and(words):
  """"a", "a and b", "a, b and c"."""
  return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


def _cluster_spec(num_ps, num_workers):
  # All sockets stay bound until every port is known, so no port repeats.
  with contextlib.ExitStack() as stack:
    sockets = [stack.enter_context(socket.socket())
               for _ in range(num_ps + num_workers)]
    for each in sockets:
      each.bind(("127.0.0.1", 0))
    addresses = ["127.0.0.1:{}".format(each.getsockname()[1])
                 for each in sockets]
  # A job with no tasks is left out: ClusterSpec would keep it as an empty job.
  jobs = {"chief": addresses[:1], "worker": addresses[1:num_workers],
          "ps": addresses[num_workers:]}
  return {job: tasks for job, tasks in jobs.items() if tasks}


def _parse_arguments(argv):
  parser = argparse.ArgumentParser(
      prog="python -m replicate.launch",
      description="Run one command as every task of a local TF cluster.")
  parser.add_argument("--ps", metavar="N", type=_at_least(0, int), default=0,
                      help="parameter-server tasks; the cluster is "
                      "synchronous (a command that calls "
                      "replicate.start_server) unless --asynchronous "
                      "(default: %(default)s)")
  parser.add_argument("--workers", metavar="N", type=_at_least(1, int),
                      default=2, help="training workers, the chief included "
                      "(default: %(default)s)")
  parser.add_argument("--asynchronous", action="store_true",
                      help="with --ps: the workers train asynchronously "
                      "(the Estimator's ps training, variable_strategy="
                      "'parameter_server'), so a failed worker is reported "
                      "and the others go on; without it the cluster is "
                      "synchronous and the first task that fails stops "
                      "every task (default: synchronous)")
  parser.add_argument("--evaluator", action="store_true",
                      help="also run one evaluator task (default: no "
                      "evaluator)")
  parser.add_argument("--grace", metavar="SECONDS", type=_at_least(0, float),
                      default=30.0, help="how long the workers and the "
                      "evaluator may run on after the chief exits, before "
                      "they are stopped (default: %(default)s)")
  parser.add_argument("command", nargs="*",
                      help="the command every task runs, after '--' "
                      "(required)")
  arguments = parser.parse_args(argv)
  if arguments.asynchronous and not arguments.ps:
    parser.error("argument --asynchronous: needs --ps; a cluster of the "
                 "chief and workers only is synchronous")
  if not arguments.command:
    parser.error("argument command: missing. Put the command every task runs "
                 "after '--', e.g. -- python train.py")
  return arguments


def _at_least(minimum, kind):
  """An argparse type: a finite `kind` of at least `minimum`.

  It raises ArgumentTypeError, which argparse reports naming the flag.
  """
  noun = "a whole number" if kind is int else "a number"

  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (math.isfinite(value) and value >= minimum):
      raise argparse.ArgumentTypeError(
          "must be {} of at least {}; received {!r}".format(
              noun, minimum, text))
    return value

  return parse


if __name__ == "__main__":
  sys.exit(main())
