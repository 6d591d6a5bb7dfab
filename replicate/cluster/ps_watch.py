"""A dead ps task ends every training task in seconds, naming it.

On why: a ps task that dies mid-step fails the step of a task with a ps
transfer in flight (`UnavailableError`), which the `MonitoredSession` takes
for a preemption: it makes its session again, and that waits on the dead
ps (restoring or checking its variables) until the watchdog's timeout; a
task waiting at a collective for that task waits as long. So, measured on
loopback, 7 kills of 8 cost the whole `REPLICATE_SYNC_TIMEOUT_SECS`, as a
frozen ps does. gRPC cannot tell the two apart fast (a frozen process's
sockets stay open), but the operating system can: a dead process's port
refuses connections at once, while a frozen one's still accepts them.

So each training task probes every ps task's port twice a second with a
TCP connect. A port that accepted once and then refuses is a dead ps: the
task writes why, naming the ps task, to stderr and exits with status 1
(`os._exit`: closing a session blocks on a dead ps). A probe that times out
(a frozen process, a host gone from the network) proves nothing: the
watchdog's timeout bounds those. Before a ps task first accepts, a refusal
is a ps not started yet, which the start's own waits bound.
"""

import atexit
import os
import socket
import sys
import threading
from typing import Dict

import tensorflow as tf

_PROBE_SECONDS = 0.5
_CONNECT_SECONDS = 1.0


def _refuses(address: str) -> bool:
  """Whether `address` ("host:port") refuses a TCP connection (False: it
  accepted one); raises OSError when the probe proves nothing."""
  host, port = address.rsplit(":", 1)
  try:
    socket.create_connection((host, int(port)),
                             timeout=_CONNECT_SECONDS).close()
  except ConnectionRefusedError:
    return True
  return False


class PsWatchHook(tf.compat.v1.train.SessionRunHook):
  """Probes the ps tasks from `begin` to `end`; exits at a dead one.

  `ps_tasks` maps each ps task's name (`ps:0`) to its address. `task` is
  this task's name, for the message.
  """

  def __init__(self, task: str, ps_tasks: Dict[str, str]):
    self._task = task
    self._ps_tasks = dict(ps_tasks)
    self._answered = set()  # the ps tasks whose port accepted once
    self._stopped = threading.Event()

  def begin(self):
    threading.Thread(target=self._watch, daemon=True,
                     name="replicate-ps-watch").start()
    # An error that ends the program first (a collective aborted by the
    # dead ps) still says which ps task it was.
    atexit.register(self._last_look)

  def end(self, session):
    del session
    self.disarm()

  def disarm(self):
    """No probing from now on: training ended (the ps tasks are stopped
    after it)."""
    self._stopped.set()
    atexit.unregister(self._last_look)

  def _dead(self):
    """The first ps task that answered once and now refuses, or None."""
    for name, address in self._ps_tasks.items():
      try:
        refuses = _refuses(address)
      except OSError:
        continue  # a timeout, an unreachable host: not proof of death
      if not refuses:
        self._answered.add(name)
      elif name in self._answered:
        return name
    return None

  def _message(self, name):
    return (
        "replicate: task {} lost ps task {} ({}): its server refuses "
        "connections, so it is dead, and no step can go on without the "
        "variables it holds. Exiting; restart every task, the ps tasks "
        "too, and training resumes from the chief's last checkpoint.\n"
        .format(self._task, name, self._ps_tasks[name]))

  def _watch(self):
    while not self._stopped.wait(_PROBE_SECONDS):
      dead = self._dead()
      if dead is not None and not self._stopped.is_set():
        sys.stdout.flush()
        sys.stderr.write(self._message(dead))
        sys.stderr.flush()
        os._exit(1)

  def _last_look(self):
    if self._stopped.is_set():
      return
    dead = self._dead()
    if dead is not None:
      sys.stderr.write(self._message(dead))
      sys.stderr.flush()
