"""Tests of the local launcher, with small Python children instead of TF."""

import json
import os
import pathlib
import select
import shlex
import signal
import subprocess
import sys
import threading

import pytest

from replicate import launch
from replicate.launch import LocalCluster
from conftest import RecordingLog

# Prints its TF_CONFIG, a line on stderr, then does what BEHAVIOUR_<TYPE>
# says: "exit N" (N > 0: after an error line and another), "sleep" (waits for a signal: the default for ps, as a ps
# serves forever), "ignore-term" (waits through SIGTERM) or "spawn" (waits
# with a child).
CHILD = r"""
import json, os, signal, subprocess, sys
config = json.loads(os.environ["TF_CONFIG"])
kind = config["task"]["type"]
print(json.dumps(config))
print("stderr of", kind, file=sys.stderr)
behaviour = os.environ.get("BEHAVIOUR_" + kind.upper(),
                           "sleep" if kind == "ps" else "exit 0")
if behaviour.startswith("exit"):
  code = int(behaviour.split()[1])
  if code:  # as a failing program: an error line, then a line after it
    print("ValueError: {} failed".format(kind), file=sys.stderr)
    print("closing", file=sys.stderr)
  sys.exit(code)
if behaviour == "ignore-term":
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
if behaviour == "spawn":
  grandchild = subprocess.Popen(
      [sys.executable, "-c", "import signal; signal.pause()"])
  print("grandchild", grandchild.pid)
print("ready", os.getpid(), flush=True)
signal.pause()  # runs until a signal ends it
"""
COMMAND = [sys.executable, "-c", CHILD]
REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 20


def configs_by_task(lines):
  """{"type:index": TF_CONFIG} from the children's JSON lines."""
  configs = {}
  for line in lines:
    task, _, text = line.partition("] ")
    if text.startswith("{"):
      configs.setdefault(task.lstrip("["), []).append(json.loads(text))
  return configs


def run_in_thread(function, timeout=TIMEOUT):
  """Runs `function()`, failing if it has not returned within `timeout`."""
  results = []
  thread = threading.Thread(target=lambda: results.append(function()),
                            daemon=True)
  thread.start()
  thread.join(timeout)
  assert not thread.is_alive(), "still running after {} s".format(timeout)
  return results[0]


def wait_until_gone(pid, timeout=TIMEOUT):
  """Waits (on a pidfd, no polling) until process `pid` has exited."""
  try:
    descriptor = os.pidfd_open(pid)
  except ProcessLookupError:
    return
  try:
    readable, _, _ = select.select([descriptor], [], [], timeout)
    assert readable, "process {} still alive after {} s".format(pid, timeout)
  finally:
    os.close(descriptor)


def test_each_task_gets_its_tf_config_with_distinct_loopback_ports():
  log = RecordingLog()
  with LocalCluster(COMMAND, num_ps=2, num_workers=3, evaluator=True,
                    log=log) as cluster:
    for task in [("chief", 0), ("worker", 0), ("worker", 1), ("evaluator", 0)]:
      assert cluster.wait(*task, timeout=TIMEOUT) == 0
    log.wait_for_prefix("[ps:1] ready")
    log.wait_for_prefix("[ps:0] ready")
  configs = configs_by_task(log.lines())

  assert sorted(configs) == ["chief:0", "evaluator:0", "ps:0", "ps:1",
                             "worker:0", "worker:1"]
  cluster_spec = configs["chief:0"][0]["cluster"]
  # 1 chief + (3 - 1) workers + 2 ps; the evaluator is not in the cluster.
  assert {job: len(tasks) for job, tasks in cluster_spec.items()} == {
      "chief": 1, "worker": 2, "ps": 2}
  addresses = [address for tasks in cluster_spec.values() for address in tasks]
  assert all(address.startswith("127.0.0.1:") for address in addresses)
  assert len({address.split(":")[1] for address in addresses}) == 5
  for task, [config] in configs.items():
    task_type, index = task.split(":")
    assert config == {"cluster": cluster_spec,
                      "task": {"type": task_type, "index": int(index)},
                      "environment": "cloud"}
    assert config == cluster.tf_config(task_type, int(index))


def test_stdout_and_stderr_lines_are_prefixed_with_the_task():
  log = RecordingLog()
  with LocalCluster(COMMAND, num_ps=1, num_workers=2, log=log) as cluster:
    cluster.wait("chief", 0, timeout=TIMEOUT)
    cluster.wait("worker", 0, timeout=TIMEOUT)
    log.wait_for_prefix("[ps:0] ready")
  lines = log.lines()
  for task, kind in [("chief:0", "chief"), ("worker:0", "worker"),
                     ("ps:0", "ps")]:
    assert "[{}] stderr of {}".format(task, kind) in lines
    assert "[{}] {{\"cluster\"".format(task) in "\n".join(lines)


def test_describe_counts_the_tasks_and_gives_every_port():
  cluster = LocalCluster(["python", "train.py", "--model-dir", "/tmp/a b"],
                         num_ps=2, num_workers=3, evaluator=True)
  spec = cluster.tf_config("chief", 0)["cluster"]
  ports = [address.split(":")[1] for job in ("chief", "worker", "ps")
           for address in spec[job]]
  assert cluster.describe() == (
      "Starting 1 chief, 2 workers, 2 ps and 1 evaluator on 127.0.0.1 "
      "(chief:0 port {}, worker:0 port {}, worker:1 port {}, ps:0 port {}, "
      "ps:1 port {}; the evaluator is outside the cluster spec); every task "
      "runs: python train.py --model-dir '/tmp/a b'".format(*ports))
  assert LocalCluster(COMMAND, num_ps=0, num_workers=1).describe().startswith(
      "Starting 1 chief on 127.0.0.1 (chief:0 port ")


def test_no_worker_or_ps_job_when_there_are_none():
  cluster = LocalCluster(COMMAND, num_ps=0, num_workers=1)
  assert list(cluster.tf_config("chief", 0)["cluster"]) == ["chief"]


def test_main_returns_the_chief_exit_code_and_stops_the_ps(capsys,
                                                           monkeypatch):
  # Asynchronous: the chief's exit, even a failed one, leaves the workers
  # their grace.
  monkeypatch.setenv("BEHAVIOUR_CHIEF", "exit 3")
  code = run_in_thread(lambda: launch.main(
      ["--ps", "1", "--workers", "2", "--asynchronous", "--grace", "5",
       "--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()

  assert code == 3
  [started, ended] = [line for line in output if line.startswith("[launch]")]
  spec = configs_by_task(output)["chief:0"][0]["cluster"]
  port = {job: addresses[0].split(":")[1] for job, addresses in spec.items()}
  assert started == (
      "[launch] Starting 1 chief, 1 worker and 1 ps on 127.0.0.1 (chief:0 "
      "port {}, worker:0 port {}, ps:0 port {}); every task runs: {}".format(
          port["chief"], port["worker"], port["ps"],
          shlex.join(COMMAND).replace("\n", "\\n")))
  assert ended == (
      "[launch] chief:0 exited with code 3; waiting up to 5.0 s for the "
      "workers and evaluator.")
  ps_pid = int(next(line for line in output
                    if line.startswith("[ps:0] ready")).split()[-1])
  with pytest.raises(ProcessLookupError):
    os.kill(ps_pid, 0)  # stopped and reaped by the launcher


def test_a_chief_exiting_as_its_wait_times_out_still_gets_the_grace(
    capsys, monkeypatch):
  """The chief exits between the launcher's poll timing out and its look
  for failures (a race seen once under load): it is the chief's exit, not a
  failure that ends the asynchronous cluster."""
  monkeypatch.setenv("BEHAVIOUR_CHIEF", "exit 3")
  wait, timed_out = LocalCluster.wait, []

  def wait_then_time_out(self, task_type, index, timeout):
    if task_type == "chief" and not timed_out:
      timed_out.append(wait(self, task_type, index, timeout=TIMEOUT))
      raise TimeoutError()  # as if the poll ended just before the exit
    return wait(self, task_type, index, timeout)

  monkeypatch.setattr(LocalCluster, "wait", wait_then_time_out)
  code = run_in_thread(lambda: launch.main(
      ["--ps", "1", "--workers", "2", "--asynchronous", "--grace", "5",
       "--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()
  assert timed_out == [3] and code == 3
  assert [line for line in output if line.startswith("[launch]")][1:] == [
      "[launch] chief:0 exited with code 3; waiting up to 5.0 s for the "
      "workers and evaluator."]


def test_failed_worker_of_asynchronous_training_is_reported_and_it_goes_on(
    capsys, monkeypatch):
  # --asynchronous (ps training the Estimator's way): the others go on.
  monkeypatch.setenv("BEHAVIOUR_WORKER", "exit 5")
  code = run_in_thread(lambda: launch.main(
      ["--ps", "1", "--workers", "3", "--asynchronous", "--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()

  assert code == 0
  for index in (0, 1):
    assert ("[launch] worker:{} exited with code 5 (its last error line: "
            "ValueError: worker failed); the others go on without it "
            "(asynchronous).".format(index)) in output


@pytest.mark.parametrize("num_ps", [0, 2])
def test_the_first_failure_stops_a_synchronous_cluster_at_once(
    capsys, num_ps):
  # Synchronous (the default, with or without ps tasks): worker:1 fails
  # while the chief, worker:0 and the ps tasks run on (they would wait for
  # it until their timeout). The launcher stops them at once, says who
  # failed, how and why, and exits with its code. The evaluator, outside
  # the cluster, is stopped too.
  env = {"BEHAVIOUR_CHIEF": "sleep", "BEHAVIOUR_WORKER": "sleep",
         "BEHAVIOUR_EVALUATOR": "sleep"}
  log = RecordingLog()
  with LocalCluster(COMMAND, num_ps=num_ps, num_workers=3, evaluator=True,
                    env=env, log=log) as cluster:
    for task in ("chief:0", "worker:0", "evaluator:0") + tuple(
        "ps:{}".format(i) for i in range(num_ps)):
      log.wait_for_prefix("[{}] ready".format(task))
    log.wait_for_prefix("[worker:1] ready")
    cluster.kill("worker", 1, signal.SIGUSR1)  # dies of it
    code = run_in_thread(lambda: cluster.wait_for_chief(grace=60))
    stopped = [cluster.wait(*task, timeout=0) for task in
               [("chief", 0), ("worker", 0), ("evaluator", 0)] +
               [("ps", i) for i in range(num_ps)]]

  assert code == -signal.SIGUSR1
  assert stopped == [-signal.SIGTERM] * (3 + num_ps)
  reports = [line for line in log.lines() if line.startswith("[launch]")]
  assert reports[1:] == [
      "[launch] worker:1 was killed by SIGUSR1 (no error line; its last "
      "line: ready {}); stopping every task: the synchronous cluster cannot "
      "go on without it.".format(cluster.process("worker", 1).pid)]


@pytest.mark.parametrize("failed, asynchronous", [
    ("chief", False), ("ps", False), ("ps", True)])
def test_main_exits_with_the_failed_task_code_and_its_error(
    capsys, monkeypatch, failed, asynchronous):
  # A failed chief (synchronous) or ps task (either way) stops every task
  # at once, without the workers' grace, and the launcher exits with its
  # code, naming its last error line (not the line printed after it).
  for task in ("chief", "worker", "ps"):
    monkeypatch.setenv("BEHAVIOUR_" + task.upper(),
                       "exit 7" if task == failed else "sleep")
  code = run_in_thread(lambda: launch.main(
      ["--ps", "1", "--workers", "2", "--grace", "600"] +
      (["--asynchronous"] if asynchronous else []) + ["--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()

  assert code == 7
  reports = [line for line in output if line.startswith("[launch]")]
  assert reports[1:] == [
      "[launch] {}:0 exited with code 7 (its last error line: ValueError: "
      "{} failed); stopping every task: {} cannot go on without it.".format(
          failed, failed, "training" if asynchronous else
          "the synchronous cluster")]


def test_a_failed_evaluator_is_reported_and_training_goes_on(capsys,
                                                              monkeypatch):
  monkeypatch.setenv("BEHAVIOUR_EVALUATOR", "exit 6")
  code = run_in_thread(lambda: launch.main(
      ["--workers", "3", "--evaluator", "--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()

  assert code == 0
  assert ("[launch] evaluator:0 exited with code 6 (its last error line: "
          "ValueError: evaluator failed); the others go on without it."
          in output)


def test_the_last_error_line_is_the_exception_or_replicate_message():
  tail = launch.processes.Tail()
  assert tail.last_error() == "it printed nothing"
  for line in ["INFO:tensorflow:step 3", "  ", "Traceback (most recent "
               "call last):", '  File "x.py", line 1',
               "tensorflow.python.framework.errors_impl.UnavailableError: "
               "From /job:ps/replica:0/task:0:", "Socket closed",
               "W0000 an error somewhere after it"]:
    tail.add(line)
  assert tail.last_error() == (
      "its last error line: tensorflow.python.framework.errors_impl."
      "UnavailableError: From /job:ps/replica:0/task:0:")
  tail.add("replicate: task chief:0 has been running a step for over 8 s")
  assert tail.last_error() == ("its last error line: replicate: task "
                               "chief:0 has been running a step for over 8 s")
  weak = launch.processes.Tail()
  weak.add("E0000 grpc error: connection refused")
  weak.add("done")
  assert weak.last_error() == ("its last error line: E0000 grpc error: "
                               "connection refused")


def test_default_cluster_has_no_ps(capsys):
  assert "ps" not in LocalCluster(COMMAND).tf_config("chief", 0)["cluster"]
  code = run_in_thread(lambda: launch.main(["--grace", "5", "--"] + COMMAND))
  output = capsys.readouterr().out.splitlines()

  assert code == 0
  assert output[0].startswith(
      "[launch] Starting 1 chief and 1 worker on 127.0.0.1 (chief:0 port ")
  configs = configs_by_task(output)
  assert sorted(configs) == ["chief:0", "worker:0"]
  assert sorted(configs["chief:0"][0]["cluster"]) == ["chief", "worker"]


def test_workers_still_running_after_the_grace_are_stopped():
  log = RecordingLog()
  with LocalCluster(COMMAND, num_ps=0, num_workers=2, evaluator=True,
                    env={"BEHAVIOUR_WORKER": "sleep",
                         "BEHAVIOUR_EVALUATOR": "exit 0"},
                    log=log) as cluster:
    log.wait_for_prefix("[worker:0] ready")
    code = run_in_thread(lambda: cluster.wait_for_chief(grace=0.1))
    assert code == 0
    assert cluster.wait("worker", 0, timeout=0) == -signal.SIGTERM
    assert cluster.wait("evaluator", 0, timeout=0) == 0


def test_kill_then_wait_gives_the_negative_signal():
  with LocalCluster(COMMAND, num_ps=1, num_workers=1,
                    log=RecordingLog()) as cluster:
    cluster.kill("ps", 0)
    assert cluster.wait("ps", 0, timeout=TIMEOUT) == -signal.SIGKILL
    cluster.kill("ps", 0)  # already gone: nothing to do
    assert cluster.wait("chief", 0, timeout=TIMEOUT) == 0


def test_restart_runs_the_task_again_with_the_same_tf_config():
  log = RecordingLog()
  with LocalCluster(COMMAND, num_ps=1, num_workers=2, log=log) as cluster:
    first_ps = cluster.process("ps", 0)
    log.wait_for_prefix("[ps:0] ready {}".format(first_ps.pid))
    cluster.restart("ps", 0)  # still running: stopped first
    second_ps = cluster.process("ps", 0)
    log.wait_for_prefix("[ps:0] ready {}".format(second_ps.pid))
    assert cluster.wait("worker", 0, timeout=TIMEOUT) == 0
    cluster.restart("worker", 0)
    assert cluster.wait("worker", 0, timeout=TIMEOUT) == 0

  assert first_ps.returncode == -signal.SIGTERM
  assert second_ps.pid != first_ps.pid
  configs = configs_by_task(log.lines())
  assert len(configs["ps:0"]) == 2 and len(configs["worker:0"]) == 2
  assert configs["ps:0"][0] == configs["ps:0"][1] == cluster.tf_config("ps", 0)
  assert configs["worker:0"][0] == configs["worker:0"][1]


def test_stop_kills_what_ignores_sigterm_and_the_task_children():
  log = RecordingLog()
  cluster = LocalCluster(COMMAND, num_ps=1, num_workers=1,
                         env={"BEHAVIOUR_CHIEF": "ignore-term",
                              "BEHAVIOUR_PS": "spawn"}, log=log)
  cluster.start()
  log.wait_for_prefix("[chief:0] ready")
  grandchild = int(log.wait_for_prefix("[ps:0] grandchild").split()[-1])
  log.wait_for_prefix("[ps:0] ready")
  cluster.stop(timeout=0.2)
  cluster.stop()  # idempotent

  assert cluster.process("chief", 0).returncode == -signal.SIGKILL
  assert cluster.process("ps", 0).returncode == -signal.SIGTERM
  wait_until_gone(grandchild)


def test_context_manager_stops_everything_on_exception():
  with pytest.raises(KeyError):
    with LocalCluster(COMMAND, num_ps=1, num_workers=1,
                      log=RecordingLog()) as cluster:
      raise KeyError("boom")
  assert cluster.process("ps", 0).returncode == -signal.SIGTERM


def test_wait_timeout_names_the_task():
  with LocalCluster(COMMAND, num_ps=1, num_workers=1,
                    log=RecordingLog()) as cluster:
    with pytest.raises(TimeoutError, match=r"Task ps:0 \(pid \d+\) was still "
                       r"running after 0.01 s"):
      cluster.wait("ps", 0, timeout=0.01)


@pytest.mark.parametrize("arguments, message", [
    ({"command": "python train.py"}, "non-empty list of strings"),
    ({"command": []}, "non-empty list of strings"),
    ({"num_workers": 0}, "at least 1. Received: 0"),
    ({"num_ps": -1}, "0 or more. Received: -1"),
    ({"asynchronous": True}, "needs num_ps of at least 1"),
])
def test_bad_constructor_arguments_are_refused(arguments, message):
  with pytest.raises(ValueError, match=message):
    LocalCluster(**{"command": COMMAND, **arguments})


def test_unknown_or_unstarted_task_is_refused():
  cluster = LocalCluster(COMMAND, num_ps=1, num_workers=1)
  with pytest.raises(ValueError, match="no task worker:0; its tasks are "
                     "chief:0, ps:0"):
    cluster.tf_config("worker", 0)
  with pytest.raises(RuntimeError, match="ps:0 has not been started"):
    cluster.process("ps", 0)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0", "--", "python"],
     "argument --workers: must be a whole number of at least 1; received "
     "'0'"),
    (["--workers", "two", "--", "python"],
     "argument --workers: must be a whole number of at least 1; received "
     "'two'"),
    (["--ps", "-1", "--", "python"],
     "argument --ps: must be a whole number of at least 0; received '-1'"),
    (["--ps", "1.5", "--", "python"],
     "argument --ps: must be a whole number of at least 0; received '1.5'"),
    (["--grace", "-2", "--", "python"],
     "argument --grace: must be a number of at least 0; received '-2'"),
    (["--grace", "nan", "--", "python"],
     "argument --grace: must be a number of at least 0; received 'nan'"),
    (["--ps", "1", "--"], "argument command: missing"),
    (["--workers", "2"], "argument command: missing"),
    (["--asynchronous", "--", "python"],
     "argument --asynchronous: needs --ps"),
])
def test_bad_command_lines_exit_2_naming_the_argument(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(argv)
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert error.startswith("usage: python -m replicate.launch")
  assert "python -m replicate.launch: error: " + message in error


def test_every_argument_has_help_and_its_default(capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(["--help"])
  assert exit_info.value.code == 0
  help_text = " ".join(capsys.readouterr().out.split())
  for expected in ("--ps N parameter-server tasks; the cluster is "
                   "synchronous (a command that calls replicate.start_server) "
                   "unless --asynchronous (default: 0)",
                   "--asynchronous with --ps: the workers train "
                   "asynchronously (the Estimator's ps training, "
                   "variable_strategy='parameter_server'), so a failed worker "
                   "is reported and the others go on; without it the cluster "
                   "is synchronous and the first task that fails stops every "
                   "task (default: synchronous)",
                   "--workers N training workers, the chief included "
                   "(default: 2)",
                   "--evaluator also run one evaluator task (default: no "
                   "evaluator)",
                   "(default: 30.0)",
                   "the command every task runs, after '--' (required)"):
    assert expected in help_text


def launcher(*arguments, env=None):
  """`python -m replicate.launch ...` as a subprocess, stdout piped."""
  return subprocess.Popen(
      [sys.executable, "-m", "replicate.launch"] + list(arguments),
      cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
      text=True, env={**os.environ, "PYTHONPATH": str(REPOSITORY),
                      **(env or {})})


def test_command_line_end_to_end():
  process = launcher("--ps", "1", "--workers", "2", "--asynchronous", "--",
                     *COMMAND, env={"BEHAVIOUR_CHIEF": "exit 4"})
  output, _ = process.communicate(timeout=TIMEOUT)

  assert process.returncode == 4
  lines = output.splitlines()
  for task in ("chief:0", "worker:0", "ps:0"):
    assert "[{}] stderr of {}".format(task, task.split(":")[0]) in lines
  assert lines[0].startswith("[launch] Starting 1 chief, 1 worker and 1 ps "
                             "on 127.0.0.1 (chief:0 port ")
  assert "[launch] chief:0 exited with code 4; waiting up to 30.0 s for the " \
         "workers and evaluator." in lines


@pytest.mark.parametrize("stop_signal, code", [(signal.SIGINT, 130),
                                               (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_all_tasks(stop_signal, code):
  process = launcher("--ps", "1", "--workers", "2", "--", *COMMAND,
                     env={"BEHAVIOUR_CHIEF": "sleep",
                          "BEHAVIOUR_WORKER": "sleep"})
  # Only if the launcher hangs: ends the read below instead of blocking.
  guard = threading.Timer(TIMEOUT, process.kill)
  guard.start()
  pids = []
  for line in process.stdout:
    if " ready " in line:
      pids.append(int(line.split()[-1]))
    if len(pids) == 3:
      break
  process.send_signal(stop_signal)
  process.communicate(timeout=TIMEOUT)
  guard.cancel()

  assert process.returncode == code
  for pid in pids:
    wait_until_gone(pid)


def test_help_imports_no_tensorflow():
  # The launcher needs no TensorFlow, so `--help` answers at once (3.5 s
  # behind TensorFlow's import before `import replicate` became lazy).
  program = ("import runpy, sys\n"
             "sys.argv = ['python -m replicate.launch', '--help']\n"
             "try:\n"
             "  runpy.run_module('replicate.launch', run_name='__main__')\n"
             "except SystemExit as done:\n"
             "  assert done.code == 0, done.code\n"
             "print('tensorflow' in sys.modules, "
             "sorted(m for m in sys.modules if m.startswith('replicate')))\n")
  result = subprocess.run(
      [sys.executable, "-c", program], capture_output=True, text=True,
      timeout=TIMEOUT, cwd=REPOSITORY,
      env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith("usage: python -m replicate.launch ")
  assert lines[-1] == ("False ['replicate', 'replicate._identity', "
                       "'replicate.cluster', 'replicate.cluster.processes']")
  assert result.stderr == ""
