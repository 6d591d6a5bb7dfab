"""What a ps cluster needs around the session: start, restart and shutdown.

On shutdown in synchronous mode: `SyncReplicasOptimizer`'s chief runs a
queue runner thread that waits for every replica's gradients. Once the
other workers have stopped, that wait never ends, and the
`MonitoredSession` joins the thread for `stop_grace_period_secs` (120 s,
which the Estimator does not let you change) before closing.
`PromptSyncReplicasHook` runs those threads under a coordinator of its own,
so the join does not wait for them; the session's close then cancels the
pending wait. It also closes the token queue at the end, so a worker
waiting for a token stops cleanly instead of waiting forever.

On a chief restart: by default a restarted chief restores its latest
checkpoint onto the live ps tasks, rolling back every update the other
workers made since. `NoRollbackSaver` restores only when some variable on
the ps tasks is not initialised (a fresh cluster, or a restarted ps task);
when all are, it keeps them, and since the checkpoint counts as loaded the
variables are not re-initialised either.

On a worker's start: a worker that asks for its session before the chief
has initialised the variables is told to retry in 30 s, a wait TensorFlow
hard-codes. `WaitForChiefHook` polls the ps tasks every quarter second
before the session is made, so a worker joins as soon as the chief is
ready.
"""

import time

import tensorflow as tf

_POLL_SECONDS = 0.25
_MAX_WAIT_SECONDS = 300


class PromptSyncReplicasHook(tf.compat.v1.train.SessionRunHook):
  """`SyncReplicasOptimizer.make_session_run_hook`, without the 120 s close."""

  def __init__(self, sync_optimizer, is_chief: bool, num_tokens: int = -1):
    self._hook = sync_optimizer.make_session_run_hook(is_chief, num_tokens)
    self._optimizer = sync_optimizer
    self._is_chief = is_chief
    self._coordinator = None  # the queue runner threads' own coordinator
    self._close_token_queue = None

  def begin(self):
    self._hook.begin()
    if self._is_chief:
      # Closes the token queue and cancels pending enqueues.
      self._close_token_queue = (
          self._optimizer.get_chief_queue_runner().cancel_op)

  def after_create_session(self, session, coord):
    del coord  # the session's coordinator would join the threads at close
    if self._coordinator is not None:  # the session was made again
      self._coordinator.request_stop()
    self._coordinator = tf.compat.v1.train.Coordinator(
        clean_stop_exception_types=[])
    self._hook.after_create_session(session, self._coordinator)

  def after_run(self, run_context, run_values):
    # An error in a queue runner thread stops training, as it would have.
    if self._coordinator is not None and self._coordinator.should_stop():
      self._coordinator.raise_requested_exception()

  def end(self, session):
    if self._coordinator is not None:
      self._coordinator.request_stop()
    if self._close_token_queue is not None:
      # Now, not from the stopping thread, which could lose the race with
      # the session's close: workers waiting for a token stop cleanly.
      session.run(self._close_token_queue)


class NoRollbackSaver(tf.compat.v1.train.Saver):
  """A Saver that does not restore over live, initialised ps variables."""

  def __init__(self, *args, **kwargs):
    self._report_uninitialized = None
    super().__init__(*args, **kwargs)

  def build(self):
    super().build()
    # The Scaffold builds its saver last, before finalising the graph, so
    # every variable (optimizer slots too) exists by now.
    if not tf.compat.v1.get_default_graph().finalized:
      report = tf.compat.v1.report_uninitialized_variables(
          tf.compat.v1.global_variables())
      report.mark_used()  # it runs only if there is a checkpoint to restore
      self._report_uninitialized = report

  def restore(self, sess, save_path):
    if (self._report_uninitialized is not None and
        sess.run(self._report_uninitialized).size == 0):
      tf.compat.v1.logging.info(
          "Every variable on the ps tasks is initialised: keeping their "
          "values rather than restoring %s, which is older.", save_path)
      return None
    return super().restore(sess, save_path)


class WaitForChiefHook(tf.compat.v1.train.SessionRunHook):
  """Waits, before a worker's session is made, for the chief's variables."""

  def __init__(self, master: str, session_config=None):
    self._master = master
    self._session_config = session_config

  def begin(self):
    # Global variables only: local ones are each worker's to initialise.
    report = tf.compat.v1.report_uninitialized_variables(
        tf.compat.v1.global_variables())
    deadline = time.monotonic() + _MAX_WAIT_SECONDS
    with tf.compat.v1.Session(self._master,
                              config=self._session_config) as session:
      while session.run(report).size:
        if time.monotonic() > deadline:
          tf.compat.v1.logging.warning(
              "The chief has not initialised the variables on the ps tasks "
              "after %d s; making the session anyway, which waits on.",
              _MAX_WAIT_SECONDS)
          return
        time.sleep(_POLL_SECONDS)  # the chief initialises them
