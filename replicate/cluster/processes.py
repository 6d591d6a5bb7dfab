"""The launcher's tasks as operating-system processes: logged and stopped.

On logs: each task's stdout and stderr are read line by line by a thread of
their own and written whole, with the task's prefix, to one shared stream.

On what failed: each task's reader also keeps its last line and its last
error line (a Python exception's `SomeError: ...`, replicate's own
`replicate: ...`, else a line that says "error"), which the launcher
prints when the task fails, so that the cause is on the line that says
who failed, not somewhere above among every task's output.

On stopping: a task runs in its own session, so a signal to its process
group reaches its children too. Stopping is SIGTERM to every group, then
SIGKILL to those still running when the time is up. A process is signalled
only while it has not been reaped, since after that its pid may be reused.

On the launcher's own signals: Ctrl-C or SIGTERM raises `Interrupted` in its
main thread, so that it stops every task before it exits; a second signal
while it stops them is ignored.
"""

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from typing import IO, Iterator, Optional, Sequence, TextIO


class Log:
  """One stream shared by the reader threads; a lock keeps lines whole."""

  def __init__(self, stream: TextIO):
    self._stream = stream
    self._lock = threading.Lock()

  def line(self, prefix: str, text: str) -> None:
    with self._lock:
      self._stream.write("[{}] {}\n".format(prefix, text))
      self._stream.flush()


def signal_group(process: subprocess.Popen, sig: int) -> None:
  """Sends `sig` to the process's group, unless the process was reaped."""
  # Once reaped, the pid may belong to someone else: signal only before that.
  if process.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(process.pid, sig)


def stop_processes(processes: Sequence[subprocess.Popen],
                   timeout: float) -> None:
  """SIGTERM to every process's group, then SIGKILL after `timeout` s."""
  for process in processes:
    signal_group(process, signal.SIGTERM)
  deadline = time.monotonic() + timeout
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      signal_group(process, signal.SIGKILL)
      process.wait()


# A Python exception's last traceback line (`ValueError: ...`,
# `...errors_impl.UnavailableError: ...`, as TensorFlow's are named), or
# replicate's own message on stderr (the watchdog's).
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b|replicate: )")
_ERROR_WORD = re.compile(r"error", re.IGNORECASE)


class Tail:
  """What a task printed last: its last line and its last error line."""

  def __init__(self):
    self._last = None
    self._exception = None  # a traceback's end, or replicate's message
    self._error = None  # any line that says "error"

  def add(self, line: str) -> None:
    line = line.strip()
    if not line:
      return
    self._last = line
    if _EXCEPTION_LINE.match(line):
      self._exception = line
    elif _ERROR_WORD.search(line):
      self._error = line

  def last_error(self) -> str:
    """Its last error line, described; else its last line."""
    if self._exception or self._error:
      return "its last error line: {}".format(self._exception or self._error)
    if self._last:
      return "no error line; its last line: {}".format(self._last)
    return "it printed nothing"


def stream_lines(pipe: IO[bytes], name: str, log: Log,
                 tail: Optional[Tail] = None) -> None:
  """Logs every line of `pipe` as `[name] ...` until it closes (and keeps
  the last ones in `tail`)."""
  with pipe:
    for raw in iter(pipe.readline, b""):
      line = raw.decode("utf-8", "replace").rstrip("\r\n")
      log.line(name, line)
      if tail is not None:
        tail.add(line)


def describe(returncode: int) -> str:
  """How a process ended, for the launcher's lines."""
  if returncode < 0:
    return "was killed by {}".format(signal.Signals(-returncode).name)
  return "exited with code {}".format(returncode)


class Interrupted(Exception):
  """Raised in the main thread by SIGINT or SIGTERM; args[0] is the signal."""


@contextlib.contextmanager
def signals_raise_interrupted() -> Iterator[None]:
  """SIGINT and SIGTERM raise `Interrupted` in the main thread while inside.

  The handlers before are restored on leaving; elsewhere than in the main
  thread this does nothing.
  """
  # Python lets only the main thread set signal handlers.
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  stop_signals = (signal.SIGINT, signal.SIGTERM)

  def handle(signal_number, frame):
    # A second Ctrl-C must not cut short the stopping the first one began.
    for each in stop_signals:
      signal.signal(each, signal.SIG_IGN)
    raise Interrupted(signal_number)

  previous = {each: signal.signal(each, handle) for each in stop_signals}
  try:
    yield
  finally:
    for each, handler in previous.items():
      signal.signal(each, handler if handler is not None else signal.SIG_DFL)
